"""The open defects of the shipped code that the simulator's checkers see, by name: their own
module, so that the checkers (:mod:`tensorhub.sim.checkers`) and the core observer
(:mod:`tensorhub.sim.observer`), which the checkers drive, both read it without importing
each other."""

from __future__ import annotations

KNOWN_OPEN = {
    "split_effect": "torn or mutated units read from a handle the server and the handle disagree on: the "
                    "effect of a 'split' violation, counted there",
    "retention_msg_loss": "a HostCopy offer unanswered reconnects_max + 1 times while the server is up: the "
                          "server never lists that copy, so a version kept whole only with it is dropped as "
                          "lost once its listed holders go",
    "txn_default_rounds": "default round counting is a best effort once a shard's process restarted: its "
                          "new process cannot know which round its siblings are in (HandleMachine rule 2; "
                          "exact with replicate(round=)); a replica none of whose shards restarted must "
                          "stay in step",
}
"""Open defects of the shipped code that a checker sees; their violations are counted apart
(``known_open``) until they are fixed. Remove an entry with its fix."""
