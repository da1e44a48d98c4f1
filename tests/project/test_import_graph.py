"""The package's modules import each other without a circle, counting every import: those at
module level and those inside functions (a "lazy" import that breaks a circle at import time
still ties two modules into one), ``TYPE_CHECKING`` blocks included. A circle says two modules
are one part in two files, or one reaches into its caller; its fix is a third module (as
``tensorhub.graphs.group`` sits above ``pipeline`` and ``coordinator``, ``tensorhub.sim.known``
under ``checkers`` and ``observer``)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for p in package.rglob("*.py"):
        parts = p.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph(mods: dict[str, pathlib.Path], top: str = "tensorhub") -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from a import b`` counts ``a.b`` when that
    is a module, else ``a``)."""
    graph = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                for a in node.names:
                    out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {o for o in out if o in mods and o != name and o.startswith(top)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_finder_sees_a_planted_circle_lazy_and_relative(tmp_path):
    pkg = tmp_path / "tensorhub"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from tensorhub.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tensorhub.a\n")
    (pkg / "d.py").write_text("import tensorhub.a\n")
    graph = import_graph(modules(pkg))
    assert graph["tensorhub.sub.b"] == {"tensorhub.c"}
    assert circles(graph) == [["tensorhub.a", "tensorhub.c", "tensorhub.sub.b"]]


def test_the_package_has_no_import_circle():
    graph = import_graph(modules(ROOT / "tensorhub"))
    assert len(graph) > 50, "the walk found the package"
    assert circles(graph) == []
