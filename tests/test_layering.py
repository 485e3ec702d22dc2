"""The packages' layering: each package of `fived` imports only the packages below it (imports inside
functions count). Read top to bottom, this is the architecture (docs/architecture.md says more)."""

import ast
from pathlib import Path

import fived

ROOT = Path(fived.__file__).parent

# Each entry may import itself and every entry it lists; what is not listed is refused.
BASE = {"errors", "config", "config_docs", "files", "version", "write_errors"}
TORCH = BASE | {"compat"}  # the private torch internals' one module: for the layers that run torch
MAY_IMPORT = {
    "errors": {"write_errors"},  # torch-free: what the user is told
    "config": {"errors"},
    "version": set(),
    "write_errors": set(),
    "compat": set(),
    "files": {"config", "errors"},  # the one writer of a run directory
    "config_docs": {"config", "errors"},
    "layout": {"config", "errors"},  # the torch-free core: sharding spec, rules, stages, placements, Muon's plan
    "planner": BASE | {"layout"},  # torch-free, never the runtime
    "model": TORCH | {"layout"},  # the model without parallel branches
    "data": BASE | {"layout"},  # (context parallelism's chunk layouts: fived.layout.cp_chunks)
    "checkpoint": TORCH | {"layout", "model"},
    "optim": TORCH | {"layout", "model"},
    "parallel": TORCH | {"layout", "model", "optim"},
    "hf": TORCH | {"layout", "model", "checkpoint"},
    "training": TORCH | {"layout", "planner", "model", "data", "checkpoint", "optim", "parallel", "hf"},
    "launch": TORCH | {"layout", "planner", "model", "data", "checkpoint", "optim", "parallel", "hf", "training"},
}
TOP = set(MAY_IMPORT) | {"launch"}
MAY_IMPORT["tools"] = BASE | TOP
MAY_IMPORT["api"] = BASE | TOP | {"tools"}  # the path: the CLI is a thin adapter over it, never the reverse
MAY_IMPORT["cli"] = BASE | TOP | {"tools", "api"}
MAY_IMPORT["testing"] = BASE | TOP
MAY_IMPORT["__init__"] = {"api", "config", "launch", "version"}
MAY_IMPORT["__main__"] = {"cli"}


def _entry(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0].removesuffix(".py")


def package_imports() -> dict[str, dict[str, set[str]]]:
    """{importing entry: {imported entry: the files that import it}}."""
    out: dict[str, dict[str, set[str]]] = {}
    for path in ROOT.rglob("*.py"):
        here = _entry(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != "fived" or len(parts) < 2:
                    continue
                there = parts[1]
                if there != here and ((ROOT / there).is_dir() or (ROOT / f"{there}.py").exists()):
                    out.setdefault(here, {}).setdefault(there, set()).add(str(path.relative_to(ROOT)))
    return out


def refused(graph, allowed) -> list[str]:
    return [
        f"{src} imports {dst} ({', '.join(sorted(files))})"
        for src, targets in graph.items()
        for dst, files in targets.items()
        if dst not in allowed.get(src, set())
    ]


def test_every_package_imports_only_the_layers_below_it():
    entries = {p.removesuffix(".py") for p in (x.name for x in ROOT.iterdir()) if p.endswith(".py") or p in MAY_IMPORT}
    entries.discard("assets")
    assert entries <= set(MAY_IMPORT), f"not placed in a layer: {sorted(entries - set(MAY_IMPORT))}"
    assert not refused(package_imports(), MAY_IMPORT)


def test_the_layering_check_can_fail():
    assert refused({"layout": {"parallel": {"layout/spec.py"}}}, MAY_IMPORT) == [
        "layout imports parallel (layout/spec.py)"
    ]


def test_at_most_twelve_top_level_modules():
    assert len(list(ROOT.glob("*.py"))) <= 12
