"""The package's import graph: no cycles (imports inside functions count: a lazy import hides a cycle,
it does not remove it) and no private (_underscore) name imported from another module."""

import ast
from pathlib import Path

import fived

ROOT = Path(fived.__file__).parent


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text())
    return out


def _imports(tree: ast.Module, known) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every import of a fived module anywhere in the file."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("fived"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((sub, None) if sub in known else (node.module, alias.name))
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("fived")]
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_and_no_private_imports():
    modules = _modules()
    graph, private = {}, []
    for name, tree in modules.items():
        edges = _imports(tree, modules)
        graph[name] = {m for m, _ in edges if m in modules and m != name}
        private += [
            f"{name} imports {m}.{n}"
            for m, n in edges
            if n and n.startswith("_") and not n.endswith("__") and m != name
        ]
    assert not _cycles(graph), _cycles(graph)
    assert not private, private


def test_the_checks_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from fived.parallel.mesh import _hidden\n")
    assert _imports(tree, {"fived.parallel.mesh"}) == [("fived.parallel.mesh", "_hidden")]
