"""The read loop's rules (:class:`ReadState`), shared by the NIXL reader and the simulator."""

from __future__ import annotations

import pathlib

import pytest

from tensorhub.errors import SourceStalled, TransferError
from tensorhub.transport.readstate import ReadState


def state(start=0, end=4, window=2, stall=1.0):
    return ReadState(7, start, end, window_max=window, stall_timeout_s=stall, now=0.0, source="s")


def test_only_units_the_source_holds_are_posted_in_order_within_the_window():
    st = state(window=2)
    assert st.next_to_post() is None and st.starved  # nothing known final yet
    st.source_state(7, 3, [10, 11, 12], now=0.1)
    assert st.next_to_post() == 0
    st.posted(0, 100, now=0.1)
    assert st.next_to_post() is None  # the Pacer's window: one read until the link is measured
    st.completed([0], now=0.2)
    for u in (1, 2):
        assert st.next_to_post() == u
        st.posted(u, 100, now=0.2)
        st.completed([u], now=0.3)
    assert st.next_to_post() is None and st.starved  # unit 3 is not final at the source
    for u in (0, 1, 2):  # the prefix advances in order, a unit once verified
        assert st.next_to_verify() == u and st.expected_sum(u) == 10 + u
        st.verified(u, now=0.3)
    assert st.next_to_verify() is None and st.prefix == 3 and not st.finished
    st.source_extended(3, [13], now=0.4)
    st.posted(3, 100, now=0.4)
    st.completed([3], now=0.5)
    st.verified(3, now=0.5)
    assert st.finished


def test_older_version_waits_newer_or_changed_version_fails():
    st = state()
    st.source_state(6, 4, None, now=0.1)  # assigned before it started receiving ours
    assert st.remote_progress == 0
    with pytest.raises(TransferError):
        state().source_state(8, 4, None, now=0.1)
    st.source_state(7, 1, [1], now=0.2)
    with pytest.raises(TransferError):  # it showed ours, then another: it moved on
        st.source_state(6, 4, None, now=0.3)


def test_pushes_extend_only_without_gaps():
    st = state()
    assert not st.source_extended(1, [5, 6], now=0.1)  # a gap: polling covers it
    assert st.source_extended(0, [4, 5], now=0.1)
    assert st.source_extended(1, [5, 6, 7], now=0.2) and st.remote_progress == 4
    assert st.remote_sums == [4, 5, 6, 7]
    assert not st.source_extended(0, [4], now=0.3)  # nothing new


def test_stall_fires_only_when_nothing_moved_for_the_timeout():
    st = state(stall=1.0)
    st.check_stalled(0.99)
    st.source_state(7, 1, [1], now=0.5)  # the source advanced: the clock restarts
    st.check_stalled(1.4)
    assert st.stall_due() == pytest.approx(1.5)
    with pytest.raises(SourceStalled, match="stuck at 1/4"):
        st.check_stalled(1.5)
    st.posted(0, 1, now=1.5)
    with pytest.raises(SourceStalled, match="unit 0 posted"):
        st.check_stalled(2.6, inflight=[0])
    st.completed([0], now=2.6)
    with pytest.raises(SourceStalled, match="checksum of unit 0"):
        st.check_stalled(3.7, verifying=[0])


def test_a_resumed_pull_starts_at_its_prefix_and_a_full_one_is_finished():
    st = state(start=2)
    st.source_state(7, 4, [0, 1, 2, 3], now=0.0)
    assert st.next_to_post() == 2
    assert state(start=4).finished


def test_both_read_loops_drive_the_same_rules():
    """The NIXL reader and the simulated transport use ReadState, not rules of their own."""
    root = pathlib.Path(__file__).resolve().parents[2] / "tensorhub"
    for path in ("transport/reader.py", "sim/transport.py"):
        text = (root / path).read_text()
        assert "ReadState(" in text, path
        for rule in ("next_to_post", "check_stalled", "source_state", "next_to_verify"):
            assert rule in text, (path, rule)
