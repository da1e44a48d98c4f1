"""The handle machine (``tensorhub.core.handle``) pinned by table, then review items 5-9 against
the shipped handle over an in-process server, then bugs planted in the machine that the
simulator (which drives the same machine) must catch."""

from __future__ import annotations

import time

import msgspec
import pytest

import tensorhub
from tensorhub import errors
from tensorhub.config import Config
from tensorhub.core import handle as hm
from tensorhub.core import messages as m
from tensorhub.core.state import NodeState
from tensorhub.graphs.member import GraphMember
from tensorhub.ports import LocalPort
from tensorhub.testing import workload

CFG = Config(unit_bytes=256 << 10, heartbeat_interval_s=0.2, lease_timeout_s=5.0,
             source_stall_timeout_s=1.0, request_timeout_s=2.0, failovers_max=1)
SPEC = workload.small_spec(2 << 20, big=2, tiny=12)
A1 = m.Assignment(version=1, source_id="t", source_endpoint=b"t", source_partial=False, start_unit=0, assign_no=1)
ABORT = hm.Send(m.ReplicateAbort("c"), fire=True)


def _machine(units: int = 4) -> hm.HandleMachine:
    mc = hm.HandleMachine("c", request_timeout_s=5.0, reconnects_max=1, failovers_max=1, unit_count=units)
    mc.handle(hm.Start(hm.RegisterOp(m.Register("c", "pol", "c", 0, 1, m.LayoutInfo("fp", units, 400)))), 0.0)
    assert mc.handle(hm.Replied(m.Registered()), 0.0) == [hm.Done(hm.Outcome())]
    return mc


def _reading(mc: hm.HandleMachine) -> None:
    """Start a replicate and get to its first pull."""
    cmds = mc.handle(hm.Start(hm.ReplicateOp("latest", True)), 0.0)
    assert isinstance(cmds[-1], hm.Send) and isinstance(cmds[-1].request, m.Replicate)
    assert mc.handle(hm.Replied(A1), 0.0) == [hm.Pull(A1, 0)]


def _exit_by_timeout(mc):
    mc.handle(hm.Pulled(1, "stalled"), 0.0)  # -> SourceFailed, wait
    return mc.handle(hm.Replied(m.Waiting(version=1)), 0.0)


def _exit_by_other_version(mc):
    mc.handle(hm.Pulled(1, "stalled"), 0.0)
    return mc.handle(hm.Replied(msgspec.structs.replace(A1, version=2, assign_no=2)), 0.0)


def _exit_by_interrupt(mc):
    return mc.handle(hm.Interrupted("KeyboardInterrupt"), 0.0)


def _exit_by_budget(mc):
    mc.handle(hm.Pulled(1, "bad bytes"), 0.0)
    mc.handle(hm.Replied(msgspec.structs.replace(A1, source_id="u", assign_no=2)), 0.0)  # stuck 1: backoff
    mc.handle(hm.TimerFired(), 0.0)
    mc.handle(hm.Pulled(1, "bad bytes"), 0.0)
    return mc.handle(hm.Replied(msgspec.structs.replace(A1, source_id="v", assign_no=3)), 0.0)  # stuck 2 > 1


def _exit_by_unterminated_reads(mc):
    return mc.handle(hm.Pulled(2, "stalled", not_terminal=True), 0.0)


def _exit_by_server_gone(mc):
    mc.handle(hm.Pulled(1, "stalled"), 0.0)
    mc.handle(hm.Unavailable("gone"), 0.0)  # reconnect once
    mc.handle(hm.TimerFired(), 0.0)  # announce
    return mc.handle(hm.Unavailable("gone"), 0.0)


@pytest.mark.parametrize("exit_path, code", [
    (_exit_by_timeout, "RequestTimeout"),
    (_exit_by_other_version, "InvalidState"),
    (_exit_by_interrupt, "Interrupted"),
    (_exit_by_budget, "TransferError"),
    (_exit_by_unterminated_reads, "TransferError"),
    (_exit_by_server_gone, "ServerUnavailable"),
])
def test_every_failed_exit_of_a_started_read_aborts_it_on_the_server(exit_path, code):
    """Review item 5: a read the server knows of (Replicate sent) and that ends in failure sends
    ReplicateAbort first, whatever the exit; the operation then fails with its typed error."""
    mc = _machine()
    _reading(mc)
    cmds = exit_path(mc)
    assert ABORT in cmds and isinstance(cmds[-1], hm.Fail) and cmds[-1].code == code, cmds
    assert mc.op is None and not mc.reading


@pytest.mark.parametrize("reply", [
    m.ErrorReply(code="VersionNotFound", message="none"),
    m.Failed(code="VersionExpired", message="old"),
    m.NoChange(version=1),
])
def test_a_read_the_server_ended_itself_sends_no_abort(reply):
    mc = _machine()
    mc.handle(hm.Start(hm.ReplicateOp(1, True)), 0.0)
    cmds = mc.handle(hm.Replied(reply), 0.0)
    assert not any(isinstance(c, hm.Send) for c in cmds), cmds


def test_unterminated_reads_are_never_reported_as_a_failed_source():
    """Review item 6: reads NIXL never saw end may still land; reporting the source failed would
    let the server hand it back to its writer. The machine keeps nothing and aborts instead."""
    mc = _machine()
    _reading(mc)
    cmds = mc.handle(hm.Pulled(2, "stalled", not_terminal=True), 0.0)
    assert not any(isinstance(c, hm.Send) and isinstance(c.request, m.SourceFailed) for c in cmds)
    assert hm.SetRegion(-1, 0) in cmds and mc.region_version == -1


@pytest.mark.parametrize("lost_server", ["unavailable", "unknown"])
def test_a_read_the_server_failed_is_not_announced_complete_to_its_successor(lost_server):
    """Simulator seed 12 (sharded), once heartbeats became pulses: the server failed a shard's
    read (VersionLost, its round re-resolved for the siblings); the reader learned it only from
    its pulse (``Noted(Failed)``), finished the bytes anyway, and its ReplicateDone met a
    restarted server -- which it told it was a complete holder of the lost version in that
    round: the replica's round split. The read now ends as the failure instead: an update of
    an absolute spec fails; one of a relative spec retries once in its round (simulator seed 813,
    ``source_dies_at_done`` with ``msg_loss``), and its retry's failure ends it."""
    def lose(mc):
        assert mc.handle(hm.Noted(m.Failed(code="VersionLost", message="no holder is left")), 0.0) == []
        cmds = mc.handle(hm.Pulled(4), 0.0)
        assert isinstance(cmds[-1], hm.Send) and isinstance(cmds[-1].request, m.ReplicateDone)
        if lost_server == "unavailable":
            mc.handle(hm.Unavailable("down"), 0.0)
            return mc.handle(hm.TimerFired(), 0.0)
        return mc.handle(hm.Replied(m.ErrorReply(code="UnknownClient", message="restarted")), 0.0)

    mc = _machine()
    _reading(mc)
    cmds = lose(mc)
    assert cmds == [hm.Send(m.Replicate("c", "latest", seq=1, update=True, resume_version=1, resume_units=4, call=1),
                            wait=True)], cmds
    cmds = mc.handle(hm.Replied(m.Failed(code="VersionLost", message="gone again")), 0.0)
    assert isinstance(cmds[-1], hm.Fail) and cmds[-1].code == "VersionLost", cmds
    assert mc.published is None and mc.op is None
    mc = _machine()
    mc.handle(hm.Start(hm.ReplicateOp(1, True)), 0.0)
    assert mc.handle(hm.Replied(A1), 0.0) == [hm.Pull(A1, 0)]
    cmds = lose(mc)
    assert isinstance(cmds[-1], hm.Fail) and cmds[-1].code == "VersionLost", cmds
    assert not any(isinstance(c, hm.Send) and isinstance(c.request, m.Announce) for c in cmds)
    assert mc.published is None and mc.op is None
    # Without the pulse's word the same read is announced complete (the server never failed it).
    mc = _machine()
    _reading(mc)
    mc.handle(hm.Pulled(4), 0.0)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="UnknownClient", message="restarted")), 0.0)
    assert isinstance(cmds[-1].request, m.Announce) and cmds[-1].request.holding.published == 1


def test_a_late_failed_note_of_an_earlier_read_does_not_end_the_next_one():
    """Simulator seed 273 (default workload, with no-op pushes on): the server failed the read of
    version 1 (VersionLost); the handle learned it first from its SourceFailed's reply and retried
    in its round, reading version 2, and only then did a slow progress pulse bring the same
    failure as a note. The note was taken as the failure of the read of 2: its ReplicateDone met
    a restarted server and the call ended as VersionLost instead of announcing 2 complete, while
    a follower read 2 from this handle through the restart (the user then wrote the tensors under
    it). A note names its read's version now; one of another version is not taken."""
    mc = _machine()
    _reading(mc)
    mc.handle(hm.Pulled(2, "source gone"), 0.0)  # -> SourceFailed
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="VersionLost", message="no holder is left")), 0.0)
    assert isinstance(cmds[-1].request, m.Replicate)  # the one retry, in the same round
    a2 = msgspec.structs.replace(A1, version=2, assign_no=2)
    assert mc.handle(hm.Replied(a2), 0.0) == [hm.Pull(a2, 0)]
    assert mc.handle(hm.Noted(m.Failed(code="VersionLost", message="no holder is left", version=1)), 0.0) == []
    assert isinstance(mc.handle(hm.Pulled(4), 0.0)[-1].request, m.ReplicateDone)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="UnknownClient", message="restarted")), 0.0)
    assert isinstance(cmds[-1].request, m.Announce) and cmds[-1].request.holding.published == 2, cmds
    # A note of the read in progress is still its failure.
    mc = _machine()
    mc.handle(hm.Start(hm.ReplicateOp(1, True)), 0.0)
    mc.handle(hm.Replied(A1), 0.0)
    mc.handle(hm.Noted(m.Failed(code="VersionLost", message="no holder is left", version=1)), 0.0)
    mc.handle(hm.Pulled(4), 0.0)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="UnknownClient", message="restarted")), 0.0)
    assert isinstance(cmds[-1], hm.Fail) and cmds[-1].code == "VersionLost", cmds


def _reading_r():
    """A server core where trainer "t" published version 1 of a 4-unit shard and reader "r" was
    assigned it: (core, mailboxes, apply_request)."""
    from tensorhub.core.reference import ReferenceCore
    from tensorhub.server.requests import Mailboxes, apply_request

    core, mail = ReferenceCore(CFG), Mailboxes()
    lay = m.LayoutInfo("fp", 4, 400)
    for cid in ("t", "r"):
        apply_request(core, mail, m.Register(cid, "pol", cid, 0, 1, lay, cid.encode(), "a", False), 0.0)
    apply_request(core, mail, m.Publish("t", 1), 0.0)
    assert isinstance(apply_request(core, mail, m.Replicate("r", "latest", seq=1), 0.0)[0], m.Assignment)
    return core, mail, apply_request


def test_a_failed_note_names_the_version_of_the_read_it_ends():
    """The server's side of seed 273: the Failed a progress pulse brings names the version the
    failed read was reading (the node itself has forgotten it)."""
    core, mail, apply_request = _reading_r()
    core.reading.fail(core.nodes["r"], errors.VersionLost("no holder is left"))
    reply, _ = apply_request(core, mail, m.Pulse(beats=(m.Beat("r", reading_units=2),)), 0.1)
    failed = [e for e in reply.notes["r"] if isinstance(e, m.Failed)]
    assert failed and {e.version for e in failed} == {1}, reply


def test_a_finished_read_the_server_failed_retries_a_relative_update():
    """Chaos rounds 27 and 30 (seed 0, kill_trainer_after_publish): a reader of the trainer's
    memory through the same-host tier finished every byte after the trainer died (the mapping
    stays readable); its ReplicateDone was answered VersionLost, and update("latest") raised it
    without the one retry a failed pull gets, though version 26 was still held. It retries now."""
    mc = _machine()
    _reading(mc)
    assert isinstance(mc.handle(hm.Pulled(4), 0.0)[-1].request, m.ReplicateDone)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="VersionLost", message="no holder is left")), 0.0)
    # The same round; the region still holds the finished version, offered for a resume
    assert cmds == [hm.Send(m.Replicate("c", "latest", seq=1, update=True, resume_version=1, resume_units=4, call=1),
                            wait=True)], cmds
    # Once only: a second loss in the same call ends it.
    cmds = mc.handle(hm.Replied(m.Failed(code="VersionLost", message="gone again")), 0.0)
    assert isinstance(cmds[-1], hm.Fail) and cmds[-1].code == "VersionLost", cmds


def test_a_completion_refused_by_a_restarted_server_retries_a_relative_update_in_its_round():
    """Simulator seed 94 (sharded, with the source_dies_at_done fault and the lost checker): a
    shard's ReplicateDone of version 2 met a server restart; the fresh server, told of it as an
    unconfirmed completion, refused it with VersionLost (a sibling shard had completed version 1
    in that round) and kept the shard idle. update("latest") raised it: the replica was left
    with one shard on version 1 and this one on nothing. It retries once in the same round now
    (the server then gives it the round's version)."""
    mc = _machine()
    _reading(mc)
    assert isinstance(mc.handle(hm.Pulled(4), 0.0)[-1].request, m.ReplicateDone)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="UnknownClient", message="restarted")), 0.0)
    assert isinstance(cmds[-1].request, m.Announce) and not cmds[-1].request.holding.confirmed
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="VersionLost", message="round 1 completed version 0")), 0.0)
    assert cmds == [hm.Send(m.Replicate("c", "latest", seq=1, update=True, resume_version=1, resume_units=4, call=1),
                            wait=True)], cmds
    # An absolute spec has no retry: that version is what the user asked for.
    mc = _machine()
    mc.handle(hm.Start(hm.ReplicateOp(1, True)), 0.0)
    mc.handle(hm.Replied(m.Assignment(version=1, source_id="t", source_endpoint=b"t", source_partial=False,
                                      start_unit=0, assign_no=1)), 0.0)
    mc.handle(hm.Pulled(4), 0.0)
    mc.handle(hm.Replied(m.ErrorReply(code="UnknownClient", message="restarted")), 0.0)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="VersionLost", message="refused")), 0.0)
    assert isinstance(cmds[-1], hm.Fail) and cmds[-1].code == "VersionLost", cmds


def test_retry_after_version_lost_stays_in_the_round_and_a_new_call_starts_the_next():
    mc = _machine()
    mc.handle(hm.Start(hm.ReplicateOp("latest", True)), 0.0)
    cmds = mc.handle(hm.Replied(m.Failed(code="VersionLost", message="gone")), 0.0)
    assert cmds == [hm.Send(m.Replicate("c", "latest", seq=1, update=True, call=1), wait=True)]
    mc.handle(hm.Replied(m.NoChange(version=3)), 0.0)
    cmds = mc.handle(hm.Start(hm.ReplicateOp("latest", True)), 0.0)
    assert cmds[-1].request.seq == 2
    mc.handle(hm.Replied(m.NoChange(version=3)), 0.0)
    cmds = mc.handle(hm.Start(hm.ReplicateOp("latest", True, round=7)), 0.0)
    assert cmds[-1].request.seq == 7, "an explicit round is the caller's"


def test_update_that_fails_before_writing_publishes_the_old_version_again():
    """update() is all or nothing: the server drained version 1 for the read of 2, the read
    failed before any byte of 2 was written, so the tensors still hold 1: publish it again."""
    mc = _machine()
    mc.handle(hm.Start(hm.PublishOp(1)), 0.0)
    mc.handle(hm.Replied(m.Ok()), 0.0)
    mc.handle(hm.Start(hm.ReplicateOp("latest", True)), 0.0)
    cmds = mc.handle(hm.Replied(m.Waiting(version=2)), 0.0)  # RequestTimeout: nothing assigned
    assert cmds == [ABORT, hm.Send(m.Publish("c", 1))]
    assert mc.handle(hm.Replied(m.Ok()), 0.0)[-1].code == "RequestTimeout"
    assert mc.published == 1 and mc.phase is hm.Phase.PUBLISHED
    # the same when publishing again is refused: the handle ends unpublished, region cleared
    mc.handle(hm.Start(hm.ReplicateOp("latest", True)), 0.0)
    mc.handle(hm.Replied(m.Waiting(version=2)), 0.0)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="VersionExpired", message="old")), 0.0)
    assert cmds[0] == hm.SetRegion(-1, 0) and cmds[-1].code == "RequestTimeout"
    assert mc.published is None and mc.phase is hm.Phase.IDLE


def test_version_lost_reported_for_a_failed_source_is_retried_in_the_round():
    """Found by ``tensorhub chaos``: the reader's own SourceFailed gets VersionLost (its source
    was the last holder); update("latest") moves on to the retained version, same round."""
    mc = _machine()
    _reading(mc)
    mc.handle(hm.Pulled(1, "unreachable", unreachable=True), 0.0)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="VersionLost", message="no holder")), 0.0)
    assert cmds == [hm.Send(m.Replicate("c", "latest", seq=1, update=True, resume_version=1, resume_units=1, call=1),
                            wait=True)]
    assert mc.handle(hm.Replied(m.NoChange(version=0)), 0.0)[-1] == hm.Done(hm.Outcome(action="noop", version=0))


def test_a_restarted_shard_counts_on_from_the_rounds_the_server_knows():
    mc = hm.HandleMachine("c", request_timeout_s=5.0, reconnects_max=1, failovers_max=1, unit_count=4)
    mc.handle(hm.Start(hm.RegisterOp(m.Register("c", "pol", "r", 0, 2, m.LayoutInfo("fp", 4, 400)))), 0.0)
    mc.handle(hm.Replied(m.Registered(round_seq=5)), 0.0)
    assert mc.handle(hm.Start(hm.ReplicateOp("latest", True)), 0.0)[-1].request.seq == 6


def test_a_failed_partial_read_is_hidden_and_rechecked_before_it_is_resumed():
    """Review repro 4 in the machine: the units stay for a later call, but its followers stop
    (the control block says nothing) and the later call resumes only on what the recheck kept."""
    mc = _machine(units=4)
    _reading(mc)
    mc.handle(hm.Pulled(3, "stalled"), 0.0)
    cmds = mc.handle(hm.Replied(m.Waiting(version=1)), 0.0)  # RequestTimeout
    assert hm.SetRegion(-1, 0) in cmds and (mc.region_version, mc.region_progress) == (1, 3)
    assert mc.handle(hm.Start(hm.ReplicateOp(1, False)), 0.0) == [hm.Recheck(1, 3)]
    cmds = mc.handle(hm.Rechecked(1), 0.0)
    assert cmds[0] == hm.SetRegion(1, 1)
    assert cmds[1].request.resume_version == 1 and cmds[1].request.resume_units == 1


@pytest.mark.parametrize("op, phase, code", [
    (hm.PublishOp(1), hm.Phase.OPEN, "NotRegistered"),
    (hm.RegisterOp(None), hm.Phase.IDLE, "InvalidState"),
    (hm.ReplicateOp("latest", False), hm.Phase.CLOSED, "HandleClosed"),
])
def test_illegal_operations_fail_typed_and_change_nothing(op, phase, code):
    mc = hm.HandleMachine("c", request_timeout_s=1.0, reconnects_max=1, failovers_max=1)
    mc.phase = phase
    assert mc.handle(hm.Start(op), 0.0) == [hm.Fail(code, mc.handle(hm.Start(op), 0.0)[0].message)]
    assert mc.phase is phase and mc.op is None


def test_core_imports_nothing_of_the_drivers():
    import ast
    import pathlib
    src = pathlib.Path(hm.__file__).read_text()
    names = {a.name.split(".")[0] for node in ast.walk(ast.parse(src)) if isinstance(node, ast.Import) for a in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(ast.parse(src)) if isinstance(node, ast.ImportFrom) and node.module}
    assert not names & {"ray", "torch", "nixl", "time", "threading", "asyncio", "random"}


# --------------------------------------------------------------------------- the shipped handle


def _hub(port, model="m", config=None, **kw):
    named = workload.allocate(SPEC)
    hub = tensorhub.open(model, port=port, config=config or CFG, **kw)
    hub.register(named)
    return hub, [t for _, t in named]


def test_interrupted_read_leaves_no_phantom_reader_and_the_source_can_unpublish():
    """Review item 5: KeyboardInterrupt mid-read. The server must not keep the reader (the
    source's unpublish would wait for it until its lease ran out, and beyond: it heartbeats)."""
    port = LocalPort(CFG)
    t, tt = _hub(port, replica="t")
    workload.fill_version(tt, 1)
    t.publish(1)
    r, _ = _hub(port, replica="r")
    real = type(r.reads).pull_range

    def interrupted(self, a, end_unit, **kw):
        real(self, a, 2)
        raise KeyboardInterrupt

    r.reads.pull_range = interrupted.__get__(r.reads)
    with pytest.raises(KeyboardInterrupt):
        r.replicate(1)
    assert port.core.nodes[r.client_id].state is NodeState.IDLE
    t0 = time.monotonic()
    t.unpublish()
    assert time.monotonic() - t0 < 1.0
    r.close(drop_last_copy=True); t.close(drop_last_copy=True)


def test_request_timeout_on_a_read_aborts_it():
    """Review item 5: a read that times out waiting for a source leaves no waiting reader."""
    port = LocalPort(CFG)
    t, tt = _hub(port, replica="t", config=CFG.replace(host_copy_ahead=False))  # one source only
    workload.fill_version(tt, 1)
    t.publish(1)
    first, _ = _hub(port, replica="a")
    second, _ = _hub(port, replica="b")
    # the only source serves one reader at a time: hold it with a read that never finishes
    port.call(m.Replicate(first.client_id, 1, seq=1))
    with pytest.raises(errors.RequestTimeout):
        second.replicate(1)
    assert port.core.nodes[second.client_id].state is NodeState.IDLE


def test_close_by_the_last_copy_holder_is_refused_while_others_remain():
    """Review item 8: the trainer's close() would drop the only copy of retained version 1 while
    a rollout is still registered. It is refused (typed), the copy keeps serving, the rollout
    reads it, and then the trainer closes."""
    port = LocalPort(CFG)
    t, tt = _hub(port, replica="t")
    r, rt = _hub(port, replica="r")
    workload.fill_version(tt, 1)
    t.publish(1)
    with pytest.raises(errors.LastCopyHeld):
        t.close()
    assert t.state is tensorhub.HubState.IDLE and 1 in port.core.available("m")
    assert r.replicate("latest").version == 1 and workload.digest(rt) == workload.digest(tt)
    t.close()  # r holds 1 now
    assert port.core.available("m") == [1]
    r.close()  # the last client of the model: nothing left to keep it for


def test_publish_waits_for_queued_device_work(monkeypatch):
    """Review item 9: publish synchronizes the devices of the registered tensors before the
    version becomes visible (CPU here: the call order is what can be checked; GPU unverified)."""
    port = LocalPort(CFG)
    t, tt = _hub(port, replica="t")
    order = []
    monkeypatch.setattr(tensorhub.handle.hub, "_sync_devices", lambda ts: order.append(("sync", len(ts))))
    real_call = port.call
    monkeypatch.setattr(port, "call", lambda req, wait_s=0.0: (order.append(type(req).__name__), real_call(req, wait_s))[1])
    t.publish(1)
    assert order[:2] == [("sync", len(tt)), "Publish"]
    t.close(drop_last_copy=True)


def test_graph_member_aborts_a_read_its_driver_never_finishes():
    """Review item 5 (graphs): the driver died between th_graph_begin and th_graph_finish. A
    watchdog ends the read on the server after request_timeout_s."""
    port = LocalPort(CFG)
    t, tt = _hub(port, replica="t")
    workload.fill_version(tt, 1)
    t.publish(1)

    class Member(GraphMember):
        pass

    member = Member()
    member.tensorhub_handle, _ = _hub(port, replica="g")
    out = member.th_graph_begin(1, update=False)
    assert out["action"] == "assigned"
    assert port.core.nodes[member.tensorhub_handle.client_id].state is not NodeState.IDLE
    deadline = time.monotonic() + CFG.request_timeout_s + 3.0
    while port.core.nodes[member.tensorhub_handle.client_id].state is not NodeState.IDLE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert port.core.nodes[member.tensorhub_handle.client_id].state is NodeState.IDLE
    assert member.th_graph_finish()["action"] == "none"
    t0 = time.monotonic()
    t.unpublish()
    assert time.monotonic() - t0 < 1.0
    member.tensorhub_handle.close(drop_last_copy=True); t.close(drop_last_copy=True)


# --------------------------------------------------------------------------- planted bugs


def _plant_no_abort(monkeypatch):
    def _fail(self, code, message):
        self.read.open = False
        return self._end([hm.Fail(code, message)])
    monkeypatch.setattr(hm.HandleMachine, "_fail", _fail)


def _plant_fresh_round(monkeypatch):
    real = hm.HandleMachine.replicate_request

    def replicate_request(self):
        r = real(self)
        return msgspec.structs.replace(r, seq=r.seq + 1000) if self.read.retried_lost else r
    monkeypatch.setattr(hm.HandleMachine, "replicate_request", replicate_request)


def _plant_no_recheck(monkeypatch):
    real = hm.HandleMachine.handle

    def handle(self, event, now):
        if isinstance(event, hm.Rechecked):  # believe the partial units without looking
            event = hm.Rechecked(self.region_progress)
        return real(self, event, now)
    monkeypatch.setattr(hm.HandleMachine, "handle", handle)


@pytest.mark.sim
@pytest.mark.parametrize("plant, seeds, kind", [
    (_plant_no_recheck, (36, 734), {"torn"}),  # the user's writes end up in a "finished" replica
    (_plant_no_abort, (10, 190), {"mutate", "hang"}),  # a phantom reader: a drain that never ends
    (_plant_fresh_round, (64, 98), {"txn"}),  # seeds re-found when the simulator gained the push_delay fault and noop_staleness_s
])
def test_the_simulator_catches_bugs_planted_in_the_shipped_machine(monkeypatch, plant, seeds, kind):
    """The simulator drives HandleMachine itself: a bug planted there shows as a violation (these
    seeds found each; with the machine as shipped they run clean, see test_sim)."""
    from tensorhub.sim.scenario import run_scenario

    clean = [run_scenario(s, interrupts=True) for s in seeds]
    assert all(not r.violations for r in clean)
    plant(monkeypatch)
    found = {v[0] for s in seeds for v in run_scenario(s, interrupts=True).violations}
    assert kind & found, found


@pytest.mark.sim
def test_reader_that_reported_its_announced_source_failed_is_scheduled_anew():
    """Found by the interrupt fault (seed 17, standalone): after a server restart a reader
    announced its edge to a source that had not announced yet, then reported that source failed;
    when the source announced, the edge was restored anyway and the reader waited forever."""
    from tensorhub.sim.scenario import run_scenario

    assert not run_scenario(17, "standalone").violations


@pytest.mark.sim
def test_seed_204_round_survives_a_false_eviction_then_a_server_restart():
    """Shard 1's read of v3 is failed by the server (its live source was evicted by lease), shard
    0 retries the round; a server restart follows. Once found splitting the round (v2 / v3)."""
    from tensorhub.sim.scenario import run_scenario

    assert not run_scenario(204).violations


@pytest.mark.sim
def test_seed_8419_completed_shard_binds_its_round_across_a_restart():
    """Round 4's version is lost; one shard re-resolves it and completes, the siblings are still in
    their failing reads when the server restarts and announce the lost version first. Once found
    splitting the round ({1: 3, 0: 4, 2: 4})."""
    from tensorhub.sim.scenario import run_scenario

    assert not run_scenario(8419).violations


@pytest.mark.sim
def test_seed_93_a_host_copy_is_kept_when_its_offer_is_lost_to_a_server_restart():
    """The trainer's background host copy of version 3 was offered while the server restarted;
    its announcement had carried the copy already, but the lost offer made the client free it:
    the server kept handing out a copy that no longer existed (found as a TransferError, now
    checker (h), "dangling")."""
    from tensorhub.sim.scenario import run_scenario

    r = run_scenario(93)
    assert not r.violations and "TransferError" not in r.failed


def test_hub_keeps_a_background_host_copy_whose_offer_failed_and_announces_it():
    port = LocalPort(CFG)
    t, tt = _hub(port, replica="t")
    real = port.call

    def call(req, wait_s=0.0):
        if isinstance(req, m.HostCopy):
            port.restart()  # the offer is lost with the server
            raise errors.ServerUnavailable("restarting")
        return real(req, wait_s)

    port.call = call
    workload.fill_version(tt, 1)
    t.publish(1)
    t.host_copies.start_copy(1)  # as on MakeHostCopy
    t.host_copies.stop_copy(cancel_it=False)
    assert list(t.host_copies.by_version) == [1] and 1 in t._machine.host_copies, "kept"
    port.call = real
    deadline = time.monotonic() + 10
    while not any("#host1" in n for n in port.core.nodes) and time.monotonic() < deadline:
        time.sleep(0.05)  # the heartbeat meets UnknownClient and re-announces, copy included
    assert f"{t.client_id}#host1" in port.core.nodes
    try:  # the restarted server's recovery window outlasts this config's request timeout
        t.close(drop_last_copy=True)
    except errors.RequestTimeout:
        pass
    assert t.state is tensorhub.HubState.CLOSED


@pytest.mark.parametrize("unanswered, stop_retries", [(1, False), (2, True)], ids=["retried", "after-a-pulse"])
def test_hub_offers_a_background_host_copy_again_when_its_offer_got_no_answer(unanswered, stop_retries):
    """The server is up but the HostCopy call got no answer (lost on its way): offered once,
    never again, the server never listed the copy, so later dropped a version kept whole only by
    it as lost (was known-open "retention_msg_loss", seed 932) and never dropped the copy past
    retention (seed 2941). Now it is retried with a growing pause (``retried``), and when every
    retry went unanswered or the next call stopped them, offered once more after each pulse the
    server answers (``after-a-pulse``), until the server takes (or refuses) it."""
    import dataclasses

    cfg = dataclasses.replace(CFG, reconnects_max=1, pulse_hold_s=0.0)
    port = LocalPort(cfg)
    t, tt = _hub(port, replica="t", config=cfg)
    real, lost = port.call, []

    def call(req, wait_s=0.0):
        if isinstance(req, m.HostCopy) and len(lost) < unanswered:
            lost.append(req)  # lost on the way: the server, up all along, never hears of it
            raise errors.ServerUnavailable("no answer")
        return real(req, wait_s)

    port.call = call
    try:
        workload.fill_version(tt, 1)
        t.publish(1)
        t.host_copies.start_copy(1)  # as on MakeHostCopy
        if stop_retries:
            t.host_copies.stop_copy(cancel_it=False)
        deadline = time.monotonic() + 10
        while f"{t.client_id}#host1" not in port.core.nodes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(lost) == unanswered and f"{t.client_id}#host1" in port.core.nodes and not t.host_copies.unoffered
    finally:
        port.call = real
        t.close(drop_last_copy=True)


@pytest.mark.sim
def test_seed_2160_a_drop_queued_before_a_reannouncement_does_not_free_the_announced_copy():
    """The server refused the trainer's background host copy of version 3 (DropHostCopy queued),
    then evicted the trainer, which re-announced with the copy before it had taken that note:
    the stale drop freed a copy the fresh registration had handed back to the server."""
    from tensorhub.sim.scenario import run_scenario

    assert not run_scenario(2160).violations


def test_an_announcement_supersedes_queued_drops_of_the_copies_it_carries():
    from tensorhub.server.requests import Mailboxes

    mail = Mailboxes()
    mail.route([m.Deliver("c", m.DropHostCopy(3)), m.Deliver("c", m.DropHostCopy(4)),
                m.Deliver("c", m.Evicted("lease expired"))])
    mail.drop_superseded("c", {3})
    assert mail.pop_background("c") == [m.DropHostCopy(4), m.Evicted("lease expired")]


@pytest.mark.sim
def test_seed_8444_a_read_failed_before_a_restart_does_not_finish_in_a_moved_round():
    from tensorhub.sim.scenario import run_scenario

    assert not run_scenario(8444).violations


@pytest.mark.sim
def test_seed_1882_readers_waiting_for_an_asked_seeder_are_released_when_a_newer_seed_replaces_it():
    """Simulator seed 1882 (crossdc): two readers of dc2 waited for version 3's asked seeder (a
    client that ignores SeedAhead); version 4's seed replaced that entry before it expired, and
    nothing looked at version 3's waiting readers again: they hung. Replacing an entry now
    re-pumps its version's groups."""
    from tensorhub.sim.scenario import run_scenario

    assert not run_scenario(1882).violations


# --------------------------------------------------------------------------- the simulator's known-open classes, fixed


def test_a_read_the_server_ended_hides_its_partial_region():
    """(was known-open "control") VersionLost answers the pull's SourceFailed: the server ended
    the read, so nothing is aborted, but the two units in place must stop being advertised
    before the user may write the tensors. Before: SetRegion(-1, 0) only while the read was open."""
    mc = _machine()
    mc.handle(hm.Start(hm.ReplicateOp(1, False)), 0.0)  # a fixed version: VersionLost is not retried
    assert mc.handle(hm.Replied(A1), 0.0) == [hm.Pull(A1, 0)]
    mc.handle(hm.Pulled(2, "stalled"), 0.0)
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="VersionLost", message="gone")), 0.0)
    assert cmds == [hm.SetRegion(-1, 0), hm.Fail("VersionLost", "gone")]
    assert (mc.region_version, mc.region_progress) == (1, 2)  # kept for a rechecked resume


def test_a_publish_without_a_reply_is_held_as_published_until_unpublished():
    """No reply (ServerUnavailable): the server may have applied the publish and may be sending
    readers here (a reply lost; simulator mixed seeds 5515, 6271, 6896: resharded reads kept
    being assigned to a trainer shard whose handle had hidden its bytes, and its next publish was
    refused). The handle holds the version as published, its region still advertised, and says
    so; the user's unpublish() drains it (the server answers UnpublishDone(-1) if it never
    applied it), and only then are the tensors the user's. (Before, it hid the region and let the
    user write, the earlier "control_publish" fix: right for the control block, wrong for the
    server's table.)"""
    mc = _machine()
    assert mc.handle(hm.Start(hm.PublishOp(1)), 0.0)[0] == hm.SetRegion(1, 4, None)
    mc.handle(hm.Unavailable("down"), 0.0)
    mc.handle(hm.TimerFired(), 0.0)  # announce
    cmds = mc.handle(hm.Unavailable("down"), 0.0)
    assert len(cmds) == 1 and cmds[0].code == "ServerUnavailable" and "unpublish() before writing" in cmds[0].message
    assert mc.published == 1 and (mc.region_version, mc.region_progress) == (1, 4)
    # publishing another version first is refused as for any published handle
    refused = mc.handle(hm.Start(hm.PublishOp(2)), 0.0)
    assert isinstance(refused[-1], hm.Fail) and refused[-1].code == "InvalidState" and mc.published == 1
    cmds = mc.handle(hm.Start(hm.UnpublishOp()), 0.0)
    assert any(isinstance(c, hm.Send) and isinstance(c.request, m.Unpublish) for c in cmds), cmds
    cmds = mc.handle(hm.Replied(m.UnpublishDone(version=-1)), 0.0)
    assert mc.published is None and mc.region_version == -1
    assert isinstance(cmds[-1], hm.Done) and cmds[-1].outcome.was_published == 1


def test_evicted_while_draining_is_an_unpublish():
    """(seed 12) a sibling's process died while this shard's unpublish drained: the server
    evicted the replica. The handle must not stay published with its control block advertising
    the version while the user writes the tensors (and then re-announce it)."""
    mc = _machine()
    mc.handle(hm.Start(hm.PublishOp(1)), 0.0)
    mc.handle(hm.Replied(m.Ok()), 0.0)
    assert mc.handle(hm.Start(hm.UnpublishOp()), 0.0) == [hm.Send(m.Unpublish("c"), wait=True)]
    cmds = mc.handle(hm.Replied(m.Evicted(reason="process gone")), 0.0)
    assert cmds == [hm.SetRegion(-1, 0), hm.Done(hm.Outcome(was_published=1))]
    assert mc.published is None and mc.phase is hm.Phase.IDLE


def test_a_completed_read_keeps_offering_its_completion_past_reconnects_max():
    """(seeds 190, 813) every byte is in place and ReplicateDone got no answer: giving up after
    ``reconnects_max`` left the server listing a published holder the handle hid. The
    completion is tried for a request timeout of its own, then fails; the handle then holds the
    version as published, its region still shown (mixed_spot seed 5092: after that timeout too
    the server listed it published and a reader read from it while the handle had hidden its
    region and let the user write): the user unpublishes before writing, as after a publish
    that got no answer. The abort goes out as before (refused if the completion was applied)."""
    mc = _machine()
    _reading(mc)
    assert mc.handle(hm.Pulled(4), 1.0) == [hm.Send(m.ReplicateDone("c", 1))]
    for t in (1.5, 2.0, 3.0):  # reconnects_max is 1: before, the second Unavailable failed the call
        assert isinstance(mc.handle(hm.Unavailable("lost"), t)[0], hm.Reconnect)
        assert mc.handle(hm.TimerFired(), t)[0].request == mc.announce_request(m.ReplicateDone("c", 1))
    assert mc.handle(hm.Replied(m.Ok()), 3.5)[-1].outcome.action == "replicated"
    assert mc.published == 1
    mc2 = _machine()
    _reading(mc2)
    mc2.handle(hm.Pulled(4), 1.0)
    mc2.handle(hm.Unavailable("lost"), 1.5)
    mc2.handle(hm.TimerFired(), 1.5)
    cmds = mc2.handle(hm.Unavailable("lost"), 6.5)  # past 1 + 5 s
    assert cmds[-1].code == "ServerUnavailable" and "may have been applied" in cmds[-1].message, cmds
    assert ABORT in cmds and not any(isinstance(c, hm.SetRegion) for c in cmds), cmds
    assert mc2.published == 1 and mc2.phase is hm.Phase.PUBLISHED
    # unpublish() then hides it as for any published version.
    cmds = mc2.handle(hm.Start(hm.UnpublishOp()), 7.0)
    assert cmds[-1] == hm.Send(m.Unpublish("c"), wait=True), cmds


def test_an_invalid_state_progress_beat_is_not_a_read_failure():
    """(seed 8) the server completed the read (its ReplicateDone reply was lost) and refuses the
    next progress beat with InvalidState: the pulse must not hand the handle a Failed note that
    ends its call while the server lists it published. A read the server failed still is one."""
    core, mail, apply_request = _reading_r()
    assert apply_request(core, mail, m.ReplicateDone("r", 1), 0.1)[0] == m.Ok()
    reply, _ = apply_request(core, mail, m.Pulse(beats=(m.Beat("r", reading_units=4),)), 0.2)
    assert not any(isinstance(e, m.Failed) for e in reply.notes.get("r", ())), reply
    core.nodes["r"].state, core.nodes["r"].failure = NodeState.IDLE, m.Failed(code="VersionLost", message="gone")
    reply, _ = apply_request(core, mail, m.Pulse(beats=(m.Beat("r", reading_units=2),)), 0.3)
    assert reply.notes["r"] == [m.Failed(code="VersionLost", message="gone")]


def test_a_staging_copy_waits_one_lease_for_its_siblings():
    """(was known-open "hang_sharded_stage", seeds 63, 111, 369) a staging shard whose sibling
    staging copy was lost with its process retried ReplicaIncomplete for the whole request
    timeout (300 s by default). With ``incomplete_wait_s`` (one lease, set by the drivers of a
    staging copy) it fails with ReplicaIncomplete after that."""
    mc = _machine()
    mc.incomplete_wait_s = 1.0
    mc.handle(hm.Start(hm.ReplicateOp(2, True)), 0.0)
    busy = m.ErrorReply(code="ReplicaIncomplete", message="only 1 of 2")
    assert mc.handle(hm.Replied(busy), 0.5) == [hm.Sleep(hm.RETRY_PAUSE_S)]
    mc.handle(hm.TimerFired(), 0.6)
    assert mc.handle(hm.Replied(busy), 1.2) == [hm.Fail("ReplicaIncomplete", "only 1 of 2")]


def test_a_refused_or_demoted_unconfirmed_completion_leaves_the_handle_idle():
    """Simulator seed 1496 (sharded): a ReplicateDone that met a restart is announced unconfirmed;
    the fresh server refuses it when a sibling completed the round at another version (a
    relative update retries once in the round, seed 94; if that fails too the update fails
    VersionLost, nothing advertised), or demotes it later (``Demoted``: the handle drops its
    published version and hides the region, once)."""
    mc = _machine()
    _reading(mc)
    mc.handle(hm.Pulled(4), 0.0)
    mc.handle(hm.Unavailable("down"), 0.0)
    (cmd,) = mc.handle(hm.TimerFired(), 0.0)
    assert isinstance(cmd.request, m.Announce) and cmd.request.holding.confirmed is False
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="VersionLost", message="unconfirmed completion refused")), 0.0)
    assert isinstance(cmds[-1].request, m.Replicate) and cmds[-1].request.seq == 1, cmds
    cmds = mc.handle(hm.Replied(m.ErrorReply(code="VersionLost", message="refused again")), 0.0)
    assert cmds[-1] == hm.Fail("VersionLost", "refused again")
    assert hm.SetRegion(-1, 0) in cmds and mc.published is None and mc.op is None
    mc = _machine()
    _reading(mc)
    mc.handle(hm.Pulled(4), 0.0)
    mc.handle(hm.Unavailable("down"), 0.0)
    mc.handle(hm.TimerFired(), 0.0)
    assert mc.handle(hm.Replied(m.Ok()), 0.0)[-1].outcome.version == 1
    assert mc.handle(hm.Noted(m.Demoted(version=2, reason="stale")), 0.0) == [] and mc.published == 1
    assert mc.handle(hm.Noted(m.Demoted(version=1, reason="lost to a confirmed sibling")), 0.0) == [hm.SetRegion(-1, 0)]
    assert mc.published is None and mc.phase is hm.Phase.IDLE and mc.region_version == -1
    assert mc.handle(hm.Noted(m.Demoted(version=1, reason="repeated")), 0.0) == []
    assert mc.holding() == m.Holding()


def test_a_held_back_unconfirmed_completion_is_announced_again_after_a_pause():
    """Simulator seeds 8622, 8753: a fresh server holds an unconfirmed completion back
    (``ServerRecovering``) until the replica's siblings are heard from. The handle announces the
    same holding again after ``RETRY_PAUSE_S`` for a request timeout from the first such answer,
    then fails typed; nothing is published meanwhile. Seed 1165: the wait must not use up the
    completion's own retries: an answer lost once the server took it is asked for again."""
    mc = _machine()
    _reading(mc)
    mc.handle(hm.Pulled(4), 1.0)
    mc.handle(hm.Unavailable("down"), 1.0)
    (announce,) = mc.handle(hm.TimerFired(), 1.0)
    recovering = m.ErrorReply(code="ServerRecovering", message="waits for its siblings")
    for t in (1.1, 2.0, 5.5):
        assert mc.handle(hm.Replied(recovering), t) == [hm.Sleep(hm.RETRY_PAUSE_S)]
        assert mc.step is hm.Step.ANNOUNCE_PAUSE and mc.published is None
        assert mc.handle(hm.TimerFired(), t + hm.RETRY_PAUSE_S) == [announce]
    for t in (7.0, 8.0):  # past 1 + 5 s and reconnects_max: accepted, the answer lost twice
        assert isinstance(mc.handle(hm.Unavailable("lost"), t)[0], hm.Reconnect)
        assert mc.handle(hm.TimerFired(), t) == [announce]
    assert mc.handle(hm.Replied(m.Ok()), 8.5)[-1].outcome.action == "replicated" and mc.published == 1
    mc2 = _machine()
    _reading(mc2)
    mc2.handle(hm.Pulled(4), 1.0)
    mc2.handle(hm.Unavailable("down"), 1.0)
    mc2.handle(hm.TimerFired(), 1.0)
    assert mc2.handle(hm.Replied(recovering), 2.0) == [hm.Sleep(hm.RETRY_PAUSE_S)]
    mc2.handle(hm.TimerFired(), 2.1)
    cmds = mc2.handle(hm.Replied(recovering), 7.0)  # past 2 + 5 s
    assert cmds[-1] == hm.Fail("ServerRecovering", "waits for its siblings") and mc2.published is None
    assert hm.SetRegion(-1, 0) in cmds


def test_a_completion_held_back_by_a_fresh_server_is_sent_again_after_a_pause():
    """Simulator seed 1774 (workload "sharded"): a fresh server holds a completion in a round
    known only from announcements back (``ServerRecovering``) until every sibling re-announced.
    The handle sends the same ``ReplicateDone`` again after ``RETRY_PAUSE_S``, for a request
    timeout from the first such answer, then fails typed; nothing is published meanwhile. A
    refusal after the wait (the round settled at another version) is the lost-version retry."""
    mc = _machine()
    _reading(mc)
    (done,) = mc.handle(hm.Pulled(4), 1.0)
    assert isinstance(done.request, m.ReplicateDone)
    recovering = m.ErrorReply(code="ServerRecovering", message="waits for its siblings to re-announce")
    for t in (1.1, 2.0, 5.5):
        assert mc.handle(hm.Replied(recovering), t) == [hm.Sleep(hm.RETRY_PAUSE_S)]
        assert mc.step is hm.Step.RETRY_PAUSE and mc.published is None
        assert mc.handle(hm.TimerFired(), t + hm.RETRY_PAUSE_S) == [done]
    lost = m.ErrorReply(code="VersionLost", message="round 1 of replica c moved to version 2")
    (retry,) = mc.handle(hm.Replied(lost), 5.7)
    assert isinstance(retry.request, m.Replicate) and retry.request.spec == "latest"
    mc2 = _machine()
    _reading(mc2)
    mc2.handle(hm.Pulled(4), 1.0)
    assert mc2.handle(hm.Replied(recovering), 1.1) == [hm.Sleep(hm.RETRY_PAUSE_S)]
    mc2.handle(hm.TimerFired(), 1.2)
    cmds = mc2.handle(hm.Replied(recovering), 6.2)  # past 1.1 + 5 s
    assert cmds[-1] == hm.Fail("ServerRecovering", recovering.message) and mc2.published is None
