"""Version specs: parsing and resolution against a sorted list of available versions."""

from __future__ import annotations

from typing import Sequence, Union

from tensorhub.errors import BadVersionSpec, VersionExpired, VersionNotFound


def parse_spec(spec: Union[int, str]) -> tuple[str, int]:
    """``7`` -> ("exact", 7); ``"latest"`` -> ("latest", 0); ``"latest-2"`` -> ("latest", 2)."""
    if isinstance(spec, bool):
        raise BadVersionSpec(f"version spec {spec!r} is a bool")
    if isinstance(spec, int):
        if spec < 0:
            raise BadVersionSpec(f"version {spec} is negative")
        return ("exact", spec)
    if isinstance(spec, str):
        s = spec.strip()
        if s == "latest":
            return ("latest", 0)
        if s.startswith("latest-"):
            tail = s[len("latest-"):]
            if tail.isdigit():
                return ("latest", int(tail))
    raise BadVersionSpec(f"version spec {spec!r} is not an int >= 0, 'latest' or 'latest-k'")


def resolve(spec: Union[int, str], model: str, available: Sequence[int], expired_below: int) -> int:
    """Resolve ``spec`` against ``available`` (ascending). ``expired_below``: versions under it
    were forgotten (``VersionExpired``); anything else missing is ``VersionNotFound``."""
    kind, n = parse_spec(spec)
    if kind == "exact":
        if n in available:
            return n
        if n < expired_below:
            raise VersionExpired(f"{model}: version {n} is past retention (oldest kept {expired_below})")
        raise VersionNotFound(f"{model}: version {n} is not available (available: {list(available)})")
    if n >= len(available):
        raise VersionNotFound(f"{model}: {spec!r} asks for the {n}-th newest of {len(available)} available versions")
    return available[-1 - n]
