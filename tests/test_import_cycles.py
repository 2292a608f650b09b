"""No import circle between the modules of src/kvpilot, deferred imports included.

A circle hidden behind an import inside a function still ties two modules together: each
needs the other to be understood, tested or moved. The graph is grimp's (import-linter's
own), which reads every import statement of a module, function bodies included, and
leaves out ``if TYPE_CHECKING:`` blocks (annotations, not a run-time dependency).

:data:`KNOWN_CYCLES` lists the circles still open, each to be removed when it is opened;
the test fails on a circle not listed and on a listed one that no longer exists, so the
list can only shrink.
"""

from __future__ import annotations

import grimp

KNOWN_CYCLES: set[frozenset[str]] = set()


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_strongly_connected_finds_a_circle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [frozenset({"a", "b", "c"})]


def test_no_import_circle_between_modules():
    imports = grimp.build_graph("kvpilot", exclude_type_checking_imports=True)
    modules = set(imports.modules)
    graph = {m: set(imports.find_modules_directly_imported_by(m)) & modules for m in modules}
    cycles = set(strongly_connected(graph))
    new = sorted(sorted(c) for c in cycles - KNOWN_CYCLES)
    opened = sorted(sorted(c) for c in KNOWN_CYCLES - cycles)
    assert not new, f"import circles between modules: {new}"
    assert not opened, f"these circles are open now: remove them from KNOWN_CYCLES: {opened}"
