"""How an inference engine's integration waits for the version it was asked to take.

The vLLM and verl engines ask ``update(spec)`` again while the answer is ``VersionNotFound``
(the trainer has not published it yet). :class:`PublishWait` decides, after each such answer,
whether to ask again: up to the engine's ``wait_timeout_s`` in all (then ``RequestTimeout``),
and for at most ``stall_timeout_s`` in a row while the server says the version cannot be
published as things stand (``VersionStalled``: a trainer rank without a client after its peers
published; then that error is raised, naming the shards). A plain answer in between starts the
stall's count again (a restarted rank registered).
"""

from __future__ import annotations

import time
from typing import Optional

from tensorhub import errors


class PublishWait:
    """One wait for ``spec`` (see the module docstring): ``deadline`` (``time.monotonic()``) ends
    it whatever the answers; ``where`` prefixes its errors (``"model=policy: "``)."""

    def __init__(self, spec, deadline: float, wait_timeout_s: float, stall_timeout_s: float, where: str = "") -> None:
        self.spec = spec
        self.deadline = deadline
        self.wait_timeout_s = wait_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.where = where
        self._stalled_since: Optional[float] = None

    def after(self, answer: errors.VersionNotFound) -> None:
        """The version was not found again (``answer``): return to ask again, or raise
        ``VersionStalled`` / ``RequestTimeout`` when the wait is over."""
        now = time.monotonic()
        if not isinstance(answer, errors.VersionStalled):
            self._stalled_since = None
        elif self._stalled_since is None:
            self._stalled_since = now
        elif now - self._stalled_since > self.stall_timeout_s:
            raise errors.VersionStalled(f"{self.where}version {self.spec!r} could not be published for "
                                        f"{self.stall_timeout_s} s ({answer})")
        if now > self.deadline:
            raise errors.RequestTimeout(f"{self.where}version {self.spec!r} was not published within "
                                        f"{self.wait_timeout_s} s ({answer})")
