"""The public surface and the wire names, pinned: a change to either is a change users (and
processes of another version) see, so it must be made here on purpose.

- ``tensorhub.__all__`` (what ``import tensorhub`` promises), ``tensorhub.transport.__all__``
  and ``tensorhub.graphs.__all__``;
- the error classes: replies cross processes as ``ErrorReply(code=<class name>)`` and are
  rebuilt by name (:func:`tensorhub.errors.from_code`), so the names are the wire format;
- every error code the package writes or compares against names one of those classes (or one
  of the handle machine's own outcomes, which never cross a process).
"""

from __future__ import annotations

import pathlib
import re

import tensorhub
from tensorhub import errors

ROOT = pathlib.Path(__file__).resolve().parents[2]

PUBLIC = ["Config", "Hub", "HubState", "ReadStats", "TensorHubError", "open"]
TRANSPORT = ["Agent", "Endpoint", "KnownProgress", "MemRegion", "Region", "Source", "decode_endpoint",
             "encode_endpoint", "get_agent", "open_source", "pull"]
GRAPHS = ["GraphCache", "GraphMember", "GroupResult", "Plan", "PlanError", "batch_end", "build_plan",
          "default_cache", "replicate_group"]
ERRORS = {
    "TensorHubError": (), "ConfigError": ("TensorHubError",), "LayoutMismatch": ("TensorHubError",),
    "NotRegistered": ("TensorHubError",), "InvalidState": ("TensorHubError",),
    "ReplicaIncomplete": ("InvalidState",), "ServerRecovering": ("TensorHubError",),
    "ServerBusy": ("TensorHubError",), "ShardTaken": ("TensorHubError",),
    "VersionNotFound": ("TensorHubError",), "UnknownModel": ("VersionNotFound",),
    "DeltaPending": ("VersionNotFound",), "VersionStalled": ("VersionNotFound",),
    "VersionExpired": ("TensorHubError",), "VersionLost": ("TensorHubError",),
    "BadVersionSpec": ("TensorHubError",), "TransactionMismatch": ("TensorHubError",),
    "UnknownClient": ("TensorHubError",), "LastCopyHeld": ("InvalidState",),
    "HandleClosed": ("TensorHubError",), "ServerUnavailable": ("TensorHubError",),
    "TransferError": ("TensorHubError",), "SourceStalled": ("TransferError",),
    "SourceUnreachable": ("TransferError",), "DeltaRejected": ("TransferError",),
    "DeltaWrongBase": ("DeltaRejected",), "ReadsNotTerminal": ("TensorHubError",),
    "ChecksumMismatch": ("TensorHubError",), "MutabilityViolation": ("TensorHubError",),
    "Unauthorized": ("TensorHubError",), "OutOfBounds": ("TensorHubError",), "WrongModel": ("OutOfBounds",),
    "ClusterError": ("TensorHubError",), "RequestTimeout": ("TensorHubError",),
    "UpdateIncomplete": ("TensorHubError",),
    "LoadFailed": ("TensorHubError",),
}
"""Every error class by name, with its TensorHub parent (the wire format: renaming one breaks a
process of the previous version, which rebuilds an unknown name as a bare TensorHubError)."""
MACHINE_OUTCOMES = {"Interrupted", "ok"}
"""Codes of the handle machine's own outcomes (:mod:`tensorhub.core.handle`): never on the wire."""


def test_the_package_exports_exactly_its_public_surface():
    assert sorted(tensorhub.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(tensorhub, name) is not None, name
    assert issubclass(tensorhub.TensorHubError, Exception)


def test_transport_and_graphs_export_exactly_their_names():
    import tensorhub.graphs as graphs
    import tensorhub.transport as transport
    from tensorhub.transport import agent, nixl, reader

    assert sorted(transport.__all__) == sorted(TRANSPORT)
    assert sorted(agent.__all__ + nixl.__all__ + reader.__all__) == sorted(TRANSPORT), "re-exported by name, all of them"
    assert all(getattr(transport, n) is not None for n in TRANSPORT)
    assert sorted(graphs.__all__) == sorted(GRAPHS)
    assert all(getattr(graphs, n) is not None for n in GRAPHS)


def test_error_names_are_pinned_with_their_parents():
    found = {name: cls for name, cls in vars(errors).items()
             if isinstance(cls, type) and issubclass(cls, errors.TensorHubError) and cls.__name__ == name}
    aliases = {name: cls.__name__ for name, cls in vars(errors).items()
               if isinstance(cls, type) and issubclass(cls, errors.TensorHubError) and cls.__name__ != name}
    assert aliases == {"VersionLostError": "VersionLost"}, "an alias is a Python name only, never a code"
    assert sorted(found) == sorted(ERRORS), "an error class was added, renamed or removed: it is the wire format"
    for name, cls in found.items():
        parents = tuple(b.__name__ for b in cls.__bases__ if issubclass(b, errors.TensorHubError))
        assert parents == ERRORS[name], (name, parents)


def test_every_error_crosses_a_process_by_its_name_and_comes_back_typed():
    for name in ERRORS:
        err = getattr(errors, name)("why")
        assert errors.code_of(err) == name
        back = errors.from_code(name, "why")
        assert type(back) is type(err) and str(back) == "why"
    assert type(errors.from_code("NoSuchError", "x")) is errors.TensorHubError, "unknown names degrade, typed"


def test_every_code_the_package_names_is_an_error_class():
    pattern = re.compile(r'code(?:=| == | != )"([A-Za-z]+)"')
    bad = []
    for py in sorted((ROOT / "tensorhub").rglob("*.py")):
        for code in pattern.findall(py.read_text()):
            if code not in ERRORS and code not in MACHINE_OUTCOMES:
                bad.append(f"{py.relative_to(ROOT)}: {code}")
    assert not bad, bad


def test_old_import_paths_still_work_for_one_release():
    """Moved modules keep their old names as thin re-exports (the issue-23 layout)."""
    import tensorhub.emucluster as emucluster
    from tensorhub.testing import cluster as old

    assert old.emulated_cluster is emucluster.emulated_cluster
    assert old.EmulatedCluster is emucluster.EmulatedCluster
    assert set(old.__all__) <= set(emucluster.__all__)
