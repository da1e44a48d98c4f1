"""The reader's window and sleep policy (pure; virtual time)."""

from __future__ import annotations

import pytest

from tensorhub.transport.pacing import POLL_MIN_S, SLEEP_MAX_S, Pacer

KiB, MiB = 1 << 10, 1 << 20


def _run(pacer: Pacer, unit_bytes: int, rate_Bps: float, units: int, t: float = 0.0) -> float:
    """Feed sequential reads of ``unit_bytes`` that take ``unit_bytes / rate`` each."""
    for u in range(units):
        pacer.on_post(u, unit_bytes, t)
        t += unit_bytes / rate_Bps
        pacer.on_done([u], t)
    return t


@pytest.mark.parametrize("case, unit, rate, rtt, window", [
    # emulated 100 Mbit/s link, 512 KiB units: the link idles 0.7% between reads -> one read
    ("100 Mbit/s link", 512 * KiB, 12.5e6, 150e-6, 1),
    # local shared memory: 8 MiB at 7 GB/s, noticing and re-posting idles ~16% -> two
    ("local shm", 8 * MiB, 7e9, 40e-6, 2),
    # across datacenters: 150 Mbit/s, 30 ms round trip: a unit is 28 ms -> two
    ("cross-dc 30 ms", 512 * KiB, 18.75e6, 30e-3, 2),
    # 1 Gbit/s with a 1 ms round trip: a unit is 4.2 ms -> two
    ("1 Gbit/s 1 ms", 512 * KiB, 125e6, 1e-3, 2),
    # a fat long link hits the cap
    ("capped", 512 * KiB, 1e9, 50e-3, 8),
])
def test_window_is_one_read_plus_the_bandwidth_delay_product(case, unit, rate, rtt, window):
    p = Pacer(window_max=8)
    assert p.window() == 1  # nothing measured yet: one read at a time
    p.on_rtt(rtt)
    _run(p, unit, rate, 6)
    assert p.rate_Bps == pytest.approx(rate, rel=1e-6)
    assert p.window() == window, case


def test_rtt_keeps_the_smallest_sample():
    p = Pacer(window_max=4)
    for s in (3e-3, 2e-4, 5e-4):
        p.on_rtt(s)
    assert p.rtt_s == 2e-4


def test_two_reads_seen_done_one_poll_apart_do_not_inflate_the_rate():
    """Interleaved reads over one link finish together; seen one poll apart, they must not read
    as a transfer of a unit in 100 us (that made the window explode before)."""
    p = Pacer(window_max=8)
    p.on_post(0, MiB, 0.0)
    p.on_post(1, MiB, 0.0)
    p.on_done([0], 0.2)
    p.on_done([1], 0.2001)
    assert 2 * MiB / 0.2001 <= p.rate_Bps < 1.2 * 2 * MiB / 0.2001  # not 10 GB/s


def test_several_completions_in_one_poll_make_one_sample():
    p = Pacer(window_max=8)
    for u in range(3):
        p.on_post(u, MiB, 0.0)
    p.on_done([0, 1, 2], 0.3)
    assert p.rate_Bps == pytest.approx(3 * MiB / 0.3)
    assert p.inflight == 0


def test_rate_follows_a_link_that_slows_down():
    p = Pacer(window_max=8)
    t = _run(p, MiB, 100e6, 10)
    _run(p, MiB, 10e6, 20, t)
    assert p.rate_Bps == pytest.approx(10e6, rel=0.05)


def test_may_post_up_to_the_window():
    p = Pacer(window_max=8)
    assert p.may_post()
    p.on_post(0, MiB, 0.0)
    assert not p.may_post()  # window 1 until measured


def test_sleep_wakes_nine_tenths_into_the_predicted_read_then_polls_at_a_fortieth():
    p = Pacer(window_max=8)
    t = _run(p, MiB, 100e6, 4)  # 10.49 ms per read
    p.on_post(4, MiB, t)
    d = MiB / 100e6
    assert p.sleep_s(t, 1e-3) == pytest.approx(min(SLEEP_MAX_S, 0.9 * d))
    assert p.sleep_s(t + 0.95 * d, 1e-3) == pytest.approx(d / 40)  # due soon: poll
    assert p.sleep_s(t + 3 * d, 1e-3) == pytest.approx(d / 40)  # overdue: keep polling
    fast = Pacer(window_max=8)
    t = _run(fast, MiB, 7e9, 4)  # 0.15 ms per read: polls never faster than POLL_MIN_S
    fast.on_post(4, MiB, t)
    assert fast.sleep_s(t + 1e-3, 1e-3) == POLL_MIN_S


def test_sleep_caps_and_uses_the_callers_backoff_when_starved():
    p = Pacer(window_max=8)
    assert p.sleep_s(0.0, 1e-3) == 1e-3  # nothing posted: waiting for the source
    p.on_post(0, MiB, 0.0)
    assert p.sleep_s(0.0, 1e-3) == POLL_MIN_S  # no rate yet: poll
    t = _run(p, MiB, 1e6, 1, 0.0)  # 1 MB/s: a read takes a second
    p.on_post(1, MiB, t)
    assert p.sleep_s(t, 1e-3) == SLEEP_MAX_S


def test_starved_reader_sleeps_until_the_sources_next_unit_is_due():
    """A partial source receives over a link like ours: its next unit is due one unit time after
    its progress last moved."""
    p = Pacer(window_max=8)
    assert p.starved_s(0.0, 0.0, 1e-3) == 1e-3  # nothing measured: the caller's backoff
    t = _run(p, MiB, 100e6, 4)  # unit time d = 10.49 ms
    d = MiB / 100e6
    assert p.starved_s(t, t, 1e-3) == pytest.approx(min(SLEEP_MAX_S, 0.9 * d))
    assert p.starved_s(t + 0.95 * d, t, 1e-3) == pytest.approx(d / 40)


def _fifo_link(pacer: Pacer, unit: int, rate_Bps: float, rtt_s: float, units: int) -> tuple[float, int]:
    """Drive the pacer over a physical link: a read's request reaches the source half a round
    trip after it is posted, its bytes follow the bytes of the reads before it at ``rate``, and
    are seen half a round trip later. Returns (throughput, largest window used)."""
    pacer.on_rtt(rtt_s)
    t, link_free, posted, done, widest = 0.0, 0.0, 0, 0, 0
    flight: list[tuple[float, int]] = []  # (seen done at, unit)
    while done < units:
        while posted < units and pacer.may_post():
            pacer.on_post(posted, unit, t)
            start = max(t + rtt_s / 2, link_free)
            link_free = start + unit / rate_Bps
            flight.append((link_free + rtt_s / 2, posted))
            posted += 1
        widest = max(widest, len(flight))
        t, u = flight.pop(0)
        pacer.on_done([u], t)
        done += 1
    return units * unit / t, widest


@pytest.mark.parametrize("case, unit, rate, rtt, least, widest_max", [
    # the crossdc benchmark's link: 100 Mbit/s, 20 ms each way; a unit is 21 ms, the round trip
    # 40 ms: three reads fill it
    ("100 Mbit/s, 40 ms", 256 * KiB, 12.5e6, 40e-3, 0.9, 4),
    # a longer round trip: five reads are needed; the window sized from the throughput alone
    # stopped short of them (81% of the link in this model), the link's own rate reaches them
    ("100 Mbit/s, 80 ms", 256 * KiB, 12.5e6, 80e-3, 0.9, 6),
    # inside a datacenter: one read nearly fills it, the window stays small
    ("1 Gbit/s, 0.2 ms", 256 * KiB, 125e6, 0.2e-3, 0.85, 2),
])
def test_a_long_link_is_filled_without_posting_everything(case, unit, rate, rtt, least, widest_max):
    thr, widest = _fifo_link(Pacer(window_max=8), unit, rate, rtt, 200)
    assert thr >= least * rate, (case, thr / rate)
    assert widest <= widest_max, (case, widest)


def test_reads_seen_done_within_their_round_trip_never_make_an_infinite_rate():
    """Found by a CI run (the spot-wave Ray test): reads seen done before their round trip could
    have passed add no serve time, so the decayed sum of it reached a denormal and the link's
    rate became infinite; window() then raised OverflowError in the middle of a pull."""
    p = Pacer(window_max=8)
    p.on_rtt(1.0)
    p.on_post(0, MiB, 0.0)
    p.on_done([0], 2.0)  # one honest sample: 1 MiB in 1 s after the round trip
    t = 2.0
    for u in range(1, 4000):
        p.on_post(u, MiB, t)
        t += 1e-3
        p.on_done([u], t)
        assert 1 <= p.window() <= 8
    assert p.serve_Bps is not None and p.serve_Bps < float("inf")
