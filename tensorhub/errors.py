"""Every error TensorHub raises on purpose, in one module.

Each class says when it is raised. Errors cross process boundaries by name: the reference
core returns ``ErrorReply(code=<class name>, message=...)`` and the client re-raises the class
of that name (:func:`from_code`). All derive from :class:`TensorHubError`.
"""

from __future__ import annotations


class TensorHubError(Exception):
    """Base of every TensorHub error."""


class ConfigError(TensorHubError, ValueError):
    """A configuration value or a relation between values is invalid."""


class LayoutMismatch(TensorHubError, ValueError):
    """The registered tensors differ from the layout of this model's shard (names, dtypes,
    shapes), or a tensor cannot be registered (not contiguous, unsupported device). Also a bad
    placement (:mod:`tensorhub.placement`: a box outside its global tensor, pieces that do not
    fill their local tensor, a partial overlap inside one handle, a dtype conversion asked of a
    read, a replica leaving ranges uncovered) or two placements whose schemas disagree on a
    global tensor's dtype or shape; the message names the tensor."""


class NotRegistered(TensorHubError):
    """A call that needs registered tensors (publish, replicate, update) came before register()."""


class InvalidState(TensorHubError):
    """The call is not legal in the handle's current state (e.g. publish while another version is
    published, replicate while already replicating). Nothing was changed."""


class ReplicaIncomplete(InvalidState):
    """A sharded replica asked to replicate before all its shards registered (at startup, or
    after a server restart before every sibling re-announced). The client retries by itself
    until ``request_timeout_s``."""


class ServerRecovering(TensorHubError):
    """The server restarted recently and holders are still re-announcing, so a version spec
    cannot be resolved yet. The client retries by itself until ``request_timeout_s``."""


class ServerBusy(TensorHubError):
    """The server is too far behind to take a new registration now (``Config.register_shed_s``);
    the handle retried for ``request_timeout_s``, pausing as the server asked. Nothing was
    registered. Clients already registered are served: shedding new ones is what keeps their
    leases from running out."""


class ShardTaken(TensorHubError):
    """Another live client already registered this (model, replica, shard)."""


class VersionNotFound(TensorHubError, LookupError):
    """The version spec names no available version (never published, or not yet complete)."""


class VersionStalled(VersionNotFound):
    """The version is not available, and it cannot become so as things stand: every replica
    that publishes it has published it from some shards only, and each lacks a client for one
    of its other shards (not registered yet, or it left or died before publishing). It becomes
    available once those shards register (a restarted trainer rank) and publish it, so a reader
    may wait a while, then give up: the engines of the vLLM and verl integrations wait
    ``stall_timeout_s`` for it, not their whole ``wait_timeout_s``."""


class DeltaPending(VersionNotFound):
    """No delta of that version is offered yet, but its publisher offered one of the version
    before and publishes this one: it is being encoded. Ask again shortly
    (``Config.seed_delta_wait_s``)."""


class UnknownModel(VersionNotFound):
    """No replica of this model is registered with the server, so no version of it can be found
    (a :class:`VersionNotFound`: to a reader, an unknown model has no versions)."""


class VersionExpired(TensorHubError, LookupError):
    """The version is older than the newest ``versions_retained`` versions and was forgotten."""


class VersionLost(TensorHubError):
    """Every holder of the version died or left before the read could finish. Retry with a newer
    spec; ``update("latest")`` does so by itself."""


VersionLostError = VersionLost
"""Alias of :class:`VersionLost`."""


class BadVersionSpec(TensorHubError, ValueError):
    """A version spec is not an int >= 0, ``"latest"`` or ``"latest-k"``."""


class TransactionMismatch(TensorHubError):
    """Shards of one replica asked for different version specs in the same replicate round."""


class UnknownClient(TensorHubError):
    """The server does not know this client (it expired, or the server restarted). The client
    re-registers and re-announces what it holds."""


class LastCopyHeld(InvalidState):
    """``close()`` would drop the last live non-spot copy of a retained version while other
    clients of the model remain (they could no longer read it). The handle stays open and keeps
    serving the copy; close again once another holder has it, or ``close(drop_last_copy=True)``."""


class HandleClosed(TensorHubError):
    """The handle was closed; open a new one."""


class ServerUnavailable(TensorHubError):
    """The reference server could not be reached within the request timeout."""


class TransferError(TensorHubError):
    """A read failed in the transport (source gone, registration lost, ...)."""


class SourceStalled(TransferError):
    """The source's progress did not advance within ``source_stall_timeout_s``."""


class SourceUnreachable(TransferError):
    """The reader could not reach its source at all (the agent cannot be added, the connection is
    refused, the first control read fails): most likely its process is gone."""


class DeltaRejected(TransferError):
    """A version's delta (:mod:`tensorhub.transport.delta`) was not applied: its bytes are
    malformed or damaged in transit (lengths, indices or its payload checksum do not hold), or
    the result does not match the new version's digest. The target was left untouched or must be
    treated as garbage (the message says which); the seeder takes the full seed instead."""


class DeltaWrongBase(DeltaRejected):
    """The delta was computed against another base than the bytes it was to be applied to (the
    base's digest differs): nothing was written; take the full version instead."""


class ReadsNotTerminal(TensorHubError):
    """A pull failed or was stopped while reads it had posted were still in flight, and NIXL did
    not report them done or failed within ``source_stall_timeout_s``: a late READ may still write
    units of the reader's region at or past its progress. The region keeps those reads and
    refuses other pulls until ``Region.settle()`` returns True; until then do not report the
    source failed or drained (its holder could rewrite the bytes still being read) and do not
    reuse those units. Not a :class:`TransferError`, so that a handler failing over to another
    source does not catch it by accident. The pull's own error, if any, is its ``__cause__``."""


class ChecksumMismatch(TensorHubError):
    """A unit's bytes did not match the checksum its publisher computed."""


class MutabilityViolation(TensorHubError):
    """A published tensor was written before unpublish() returned (detected by checksum)."""


class Unauthorized(TensorHubError, PermissionError):
    """A request acts for a client without that client's capability (the secret its handle
    presented at its first registration), registers with a model whose server requires a model
    secret without proving it (``Config.model_secret``), asks for a server's operator view without
    it, or the server of a model with a secret could not prove it knows the secret (another job
    created a server under that name). The server changed nothing. See docs/security.md."""


class OutOfBounds(TensorHubError, ValueError):
    """A name, count, version number or layout in a request is outside its documented bound
    (:mod:`tensorhub.core.bounds`). Checked by the client before it sends and by the server
    before the request reaches its table; nothing was changed."""


class WrongModel(OutOfBounds):
    """The request names a model that its server does not serve (each model has its own server,
    ``Config.server_per_model``), or a shared server already serves ``bounds.MODELS_MAX``
    models. Nothing was changed."""


class ClusterError(TensorHubError):
    """The emulated cluster cannot be built, reached or torn down: not root, ``ip``/``tc``
    missing, a name or subnet collides with something that is not ours, a namespace or link
    cannot be created, a Ray node does not come up in time (the message carries its log tail),
    or processes survive teardown. Also raised for an invalid :class:`ClusterSpec`."""


class RequestTimeout(TensorHubError, TimeoutError):
    """A blocking call did not finish within its timeout."""


class UpdateIncomplete(TensorHubError):
    """A trainer's update of its inference engines (``send_weights`` of the vLLM backend) did
    not reach every engine: one died or its read failed. The version is published; every
    engine that took it runs it and says so (its update was finished); the others keep what
    they ran. The engines' error is the ``__cause__``."""


class LoadFailed(TensorHubError):
    """An inference engine received a version whole but could not load it (vLLM's
    ``load_weights`` or a direct copy raised part way). The engine read the version it ran
    before again and loaded it: the message says whether it runs that version again or holds
    parts of two (then update it again). The load's error is the ``__cause__``."""


_BY_NAME = {
    cls.__name__: cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, TensorHubError)
}


def from_code(code: str, message: str) -> TensorHubError:
    """Rebuild the typed error named ``code`` (unknown names become :class:`TensorHubError`)."""
    return _BY_NAME.get(code, TensorHubError)(message)


def code_of(err: TensorHubError) -> str:
    return type(err).__name__
