"""``tensorhub.progress.live``: a display on a terminal, nothing in pipes, logs or ``--json`` runs."""

from __future__ import annotations

import io
import sys

import pytest

from tensorhub import progress


class _Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _use(bar) -> None:
    with bar:
        task = bar.add_task("runs", total=3)
        for i in range(3):
            bar.update(task, description=f"run {i}")
            bar.advance(task)
        bar.update(task, completed=3, total=3)
        bar.remove_task(task)


@pytest.mark.parametrize("stream, json_mode", [
    (io.StringIO(), False),  # a pipe or a log file
    (io.StringIO(), True),
    (_Terminal(), True),  # --json on a terminal
], ids=["pipe", "pipe-json", "terminal-json"])
def test_live_is_silent_unless_a_terminal_without_json(stream, json_mode, capsys):
    bar = progress.live(stream, json_mode=json_mode)
    assert isinstance(bar, progress.Silent)
    _use(bar)
    assert stream.getvalue() == ""
    assert capsys.readouterr() == ("", "")


def test_live_defaults_to_stderr_and_a_closed_or_odd_stream_is_no_terminal(monkeypatch):
    closed = io.StringIO()
    closed.close()
    assert isinstance(progress.live(closed), progress.Silent)
    assert isinstance(progress.live(object()), progress.Silent)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(progress.live(), progress.Silent)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert not isinstance(progress.live(), progress.Silent)


def test_live_draws_on_a_terminal_and_leaves_stdout_alone(capsys):
    term = _Terminal()
    bar = progress.live(term)
    assert not isinstance(bar, progress.Silent)
    with bar:
        task = bar.add_task("n=4 pull", total=2)
        bar.advance(task)
        bar.refresh()
    assert "n=4 pull" in term.getvalue()
    assert capsys.readouterr().out == ""
