"""Moved: the handle is :mod:`tensorhub.handle` (``Hub`` in :mod:`tensorhub.handle.hub`).

This name stays for one release so that ``from tensorhub.client import Hub`` keeps working; new
code imports :class:`tensorhub.Hub` or :mod:`tensorhub.handle`.
"""

from tensorhub.handle import Hub, HubState, NamedTensors, ReadStats  # noqa: F401 - re-exported for old imports

__all__ = ["Hub", "HubState", "NamedTensors", "ReadStats"]
