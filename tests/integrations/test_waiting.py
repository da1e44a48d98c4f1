"""PublishWait: how the vLLM and verl engines wait for the version they were asked to take
(``tensorhub.integrations.waiting``; no vLLM, no verl, no Ray: the core environment)."""

from __future__ import annotations

import pytest

from tensorhub import errors
from tensorhub.integrations import waiting


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(waiting.time, "monotonic", c)
    return c


def test_a_version_not_published_yet_is_waited_for_until_the_deadline(clock):
    wait = waiting.PublishWait(3, deadline=clock.now + 600, wait_timeout_s=600, stall_timeout_s=60, where="m: ")
    for _ in range(10):
        clock.now += 59
        wait.after(errors.VersionNotFound("m: version 3 is not available"))
    clock.now += 20
    with pytest.raises(errors.RequestTimeout, match=r"^m: version 3 was not published within 600 s \(m: version 3"):
        wait.after(errors.VersionNotFound("m: version 3 is not available"))


def test_a_stalled_version_is_given_up_after_the_stall_timeout_counted_from_the_first_stalled_answer(clock):
    wait = waiting.PublishWait(3, deadline=clock.now + 600, wait_timeout_s=600, stall_timeout_s=60)
    stalled = errors.VersionStalled("version 3 is not available; it cannot become available: replica t ...")
    wait.after(stalled)  # the count starts here
    clock.now += 59
    wait.after(stalled)
    clock.now += 2
    with pytest.raises(errors.VersionStalled, match=r"^version 3 could not be published for 60 s \(version 3 is not"):
        wait.after(stalled)


def test_a_plain_answer_between_stalled_ones_starts_the_stall_count_again(clock):
    """A restarted trainer rank registered (plain VersionNotFound), then left again: the stall
    is counted from its second start."""
    wait = waiting.PublishWait(3, deadline=clock.now + 600, wait_timeout_s=600, stall_timeout_s=60)
    stalled = errors.VersionStalled("stalled")
    wait.after(stalled)
    clock.now += 50
    wait.after(errors.VersionNotFound("not yet"))
    clock.now += 5
    wait.after(stalled)
    clock.now += 50
    wait.after(stalled)  # 105 s since the first stalled answer, 50 s since the count restarted
    clock.now += 11
    with pytest.raises(errors.VersionStalled):
        wait.after(stalled)


def test_the_deadline_ends_a_stall_too(clock):
    wait = waiting.PublishWait("latest", deadline=clock.now + 10, wait_timeout_s=10, stall_timeout_s=60)
    wait.after(errors.VersionStalled("stalled"))
    clock.now += 11
    with pytest.raises(errors.RequestTimeout):
        wait.after(errors.VersionStalled("stalled"))
