"""Deterministic simulation of the TensorHub protocol (FoundationDB / TigerBeetle VOPR style).

One thread, virtual time that jumps to the next event, one seed that forks per-subsystem RNGs,
named bounded fault knobs, invariant checkers kept apart from the system, and a trace digest
so that the same seed provably gives the same run.

- :mod:`tensorhub.sim.loop`      event queue, virtual clock, seeded RNGs, trace digest
- :mod:`tensorhub.sim.network`   NICs (TX/RX), inter-datacenter links, control-message channels
- :mod:`tensorhub.sim.server`    the reference server: the shipped request path (ReferenceCore,
                                  mailboxes, long polls) in virtual time
- :mod:`tensorhub.sim.client`    a shard handle: a driver of the shipped HandleMachine
- :mod:`tensorhub.sim.transport` what a pull does in the simulated world (reads, cancel, stall)
- :mod:`tensorhub.sim.reshard_pull` a resharded pull (``Assignment.reshard``): the holder units
                                  its own units need, from every needed holder shard
- :mod:`tensorhub.sim.mixed`     the ``mixed`` workload's layouts, placements and reshard plans
- :mod:`tensorhub.sim.workloads` trainers, rollout fleets, spot churn
- :mod:`tensorhub.sim.faults`    named fault kinds and their bounded knobs
- :mod:`tensorhub.sim.checkers`  invariants (observers only)
- :mod:`tensorhub.sim.observer`  invariants that compare the core's table before and after a step
                                  with the world's ground truth; rare-path counts
- :mod:`tensorhub.sim.scenario`  one seeded scenario end to end: :func:`run_scenario`
- :mod:`tensorhub.sim.whatif`    benchmark-scale what-if runs (pipeline vs no pipeline)
- :mod:`tensorhub.sim.cli`       ``tensorhub simulate``
"""

from tensorhub.sim.scenario import WORKLOADS, ScenarioResult, run_scenario

__all__ = ["WORKLOADS", "ScenarioResult", "run_scenario"]
