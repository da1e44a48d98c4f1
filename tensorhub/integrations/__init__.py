"""Adapters to RL frameworks. Each module imports its framework; this package imports none.

- :mod:`tensorhub.integrations.verl`: a verl checkpoint-engine backend (``backend: tensorhub``).
"""
