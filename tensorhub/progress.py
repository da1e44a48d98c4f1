"""Live progress on a terminal, silence everywhere else.

:func:`live` gives a rich progress display when its stream is a terminal and the program is not
printing JSON, and otherwise a silent stand-in with the same calls, so callers never branch::

    with live(json_mode=args.json) as bar:
        task = bar.add_task("runs", total=n)
        ...
        bar.update(task, advance=1, description="n=4 pull")

Logs, pipes and ``--json`` runs see none of it: their plain lines and JSON stay as they are.
The display draws on its stream only (stderr by default) and is cleared when it stops. Lines
other code prints to that same stream meanwhile appear above it (rich redirects them); the other
standard stream is never redirected, so a JSON line printed on stdout is byte for byte what it
would be without the display.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, TextIO


def live(stream: Optional[TextIO] = None, *, json_mode: bool = False):
    """A started-on-enter progress display on ``stream`` (default: ``sys.stderr`` as of this
    call), or a silent stand-in when ``json_mode`` is set or ``stream`` is not a terminal.
    Both are context managers with ``add_task(description, total=None)``,
    ``update(task, advance=, description=, total=, completed=)``, ``advance(task, n)`` and
    ``remove_task(task)``; the silent one does nothing and writes nothing. One display at a
    time: several lines of progress are several tasks of one display, not several displays."""
    stream = sys.stderr if stream is None else stream
    if json_mode or not _is_terminal(stream):
        return Silent()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(file=stream), transient=True,
                    redirect_stdout=stream is sys.stdout, redirect_stderr=stream is sys.stderr)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


class Silent:
    """The display when there is none to show: every call is accepted and does nothing."""

    def __init__(self) -> None:
        self._next_task = 0

    def __enter__(self) -> "Silent":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def add_task(self, description: str, total: Optional[float] = None, **fields: Any) -> int:
        self._next_task += 1
        return self._next_task

    def update(self, task: int, **changes: Any) -> None:
        pass

    def advance(self, task: int, advance: float = 1) -> None:
        pass

    def remove_task(self, task: int) -> None:
        pass
