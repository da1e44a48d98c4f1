"""Memory tags that are not a version's: what the simulated transports leave in a unit."""

TORN = ("torn",)
"""A unit whose bytes are no version's: read while its source wrote it, or a cancelled read's junk."""
