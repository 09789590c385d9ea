"""The package's import graph has no cycle: every module can be read (and imported) after the modules it
needs, which the layer contracts in pyproject.toml (`lint-imports`) do not check by themselves."""

from __future__ import annotations

import grimp  # import-linter's graph builder


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                out.append(sorted([v, *component]))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return out


def test_the_package_has_no_import_cycle():
    assert cycles(grimp.build_graph("agent_r1")) == []


def test_a_cycle_is_found():
    """The check itself: two modules that import each other, and a third that only imports them."""
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert cycles(graph) == [["a.x", "a.y"]]
