"""Which package may import which, checked by scanning the source with ``ast`` (no imports run).

    tensorhub.testing  ->  product (core, transport, client, server, graphs, ...)
    tensorhub.graphs   -/->  tensorhub.server (but its pure ``naming``)
    the handle         -/->  tensorhub.server (it talks to a ``ServerPort``: tensorhub.ports)

Arrows point from importer to imported; nothing points back. Fixtures (synthetic weights, the
ready-made replica actor, the emulated cluster) live in ``tensorhub.testing``, which only the CLI
commands built on them (``demo``, ``chaos``, ``cli``) and the simulator may import. The rule that
``tensorhub/core`` imports no ray/torch/time/... is pinned next to the core's own tests
(``tests/core/test_core.py::test_core_has_no_forbidden_imports``).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tensorhub"

# Outside tensorhub/testing, these may import it: commands and the simulator built on fixtures.
TESTING_IMPORTERS = ("tensorhub/demo.py", "tensorhub/chaos.py", "tensorhub/cli.py", "tensorhub/sim/")


def _module_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports anywhere (top level or inside a function), as absolute
    names; ``from a import b`` yields both ``a`` and ``a.b`` (``b`` may be a submodule), and
    relative imports are resolved against the file's own package."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .x / from ..x: (level - 1) packages up from this file's own
                parts = package.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
    return out


def _imports_package(path: pathlib.Path, package: str) -> list[str]:
    return sorted(n for n in imported_modules(path) if n == package or n.startswith(package + "."))


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_scanner_sees_lazy_and_relative_imports():
    """The scan would catch a violation: demo.py imports its fixtures inside ``run``."""
    assert "tensorhub.testing.replica" in imported_modules(PACKAGE / "demo.py")
    assert _imports_package(PACKAGE / "demo.py", "tensorhub.testing")


def test_graphs_do_not_import_the_server():
    bad = {}
    for path in sorted((PACKAGE / "graphs").rglob("*.py")):
        found = [n for n in _imports_package(path, "tensorhub.server") if n != "tensorhub.server.naming"
                 and not n.startswith("tensorhub.server.naming.")]
        if found:
            bad[path.relative_to(ROOT).as_posix()] = found
    assert not bad, f"graphs import the server's side: {bad}"


def test_the_handle_does_not_import_the_server():
    """The handle knows a port, not a server: the server's side may change without it."""
    bad = {}
    for path in sorted((PACKAGE / "handle").rglob("*.py")):
        if found := _imports_package(path, "tensorhub.server"):
            bad[path.relative_to(ROOT).as_posix()] = found
    assert not bad, f"the handle imports the server's side: {bad}"


def test_only_fixtures_commands_and_sim_import_testing():
    bad = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("tensorhub/testing/") or rel.startswith(TESTING_IMPORTERS):
            continue
        if found := _imports_package(path, "tensorhub.testing"):
            bad[rel] = found
    assert not bad, f"product modules import test fixtures: {bad}"


def _hub_private_names() -> set[str]:
    """Every private member the handle's ``Hub`` class defines (methods and ``self._x = ...``)."""
    names = set()
    for path in sorted((PACKAGE / "handle").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ClassDef) and node.name == "Hub"):
                continue
            for n in ast.walk(node):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("_") \
                        and not n.name.startswith("__"):
                    names.add(n.name)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                        and n.value.id == "self" and n.attr.startswith("_") and not n.attr.startswith("__"):
                    names.add(n.attr)
    return names


def _private_uses(path: pathlib.Path, names: set[str]) -> list[str]:
    """``x._name`` for a Hub private ``_name`` on anything but ``self``/``cls``."""
    out = []
    for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(n, ast.Attribute) and n.attr in names \
                and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
    return out


def test_no_code_outside_the_handle_uses_its_private_members():
    """The handle's inside may change without the graphs, tools, fixtures or benchmarks: they
    use its public API and its named read API (``hub.reads``, :mod:`tensorhub.handle.reads`)."""
    names = _hub_private_names()
    assert {"_run", "_machine", "_memory", "_driver"} <= names  # the scan sees the class
    bad = {}
    for base in ("tensorhub", "benchmarks", "examples"):
        for path in sorted((ROOT / base).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("tensorhub/handle/"):
                continue
            if found := _private_uses(path, names):
                bad[rel] = found
    assert not bad, f"code outside tensorhub/handle/ uses the handle's private members: {bad}"


def test_the_private_member_scan_finds_a_planted_use(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(hub):\n    return hub._run(None)\n")
    assert _private_uses(planted, _hub_private_names()) == ["2: hub._run"]
