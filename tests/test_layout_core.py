"""The layout core (`fived.layout`): plain Python that imports without torch; the planner reads it and
never the runtime's `fived.parallel`; the sharding spec cuts every tensor of real models into pieces
that tile it exactly (no gap, no overlap but declared replicas)."""

import ast
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

import fived
from fived.config import model_preset
from fived.layout.spec import padded_vocab, tensor_specs

ROOT = Path(fived.__file__).parent
CORE = ["fived.layout"] + sorted(
    f"fived.layout.{p.stem}" for p in (ROOT / "layout").glob("*.py") if p.stem != "__init__"
)


def test_the_layout_core_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        f"for name in {CORE!r}: __import__(name)\n"
        "from fived.layout.rules import check_config; from fived.config import build_config\n"
        "check_config(build_config(overrides={'parallel.tp': 2, 'parallel.dp': 2}), 4); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    blocked = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['torch'] = None; import fived.parallel.mesh"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert blocked.returncode != 0  # (the check can fail: a module that needs torch does not import)


def _fived_imports(path: Path) -> set[str]:
    """Every fived module a file imports, at the top or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fived"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("fived")}
    return out


def _module_path(name: str) -> Path | None:
    rel = Path(*name.split("."))
    for candidate in (ROOT.parent / rel.with_suffix(".py"), ROOT.parent / rel / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def test_the_planner_and_the_core_never_reach_the_runtimes_parallel_modules():
    """Transitively: whatever the planner (or the core) imports imports nothing of fived.parallel."""
    for start in ["fived.planner." + p.stem for p in (ROOT / "planner").glob("*.py")] + CORE:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            path = _module_path(name)
            if name in seen or path is None:
                continue
            seen.add(name)
            todo += _fived_imports(path)
        assert not [m for m in seen if m.startswith("fived.parallel")], (start, sorted(seen))
        if start in CORE:
            assert {m for m in seen if m not in ("fived.config", "fived.errors", "fived.write_errors", "fived")} <= set(
                CORE
            ), (start, sorted(seen))


CASES = [
    ("llama3-405b", 16, 1),
    ("llama3-70b", 8, 1),
    ("llama3-8b", 4, 1),
    ("mixtral-8x7b", 4, 8),
    ("deepseek-v3-like", 8, 64),
    ("tiny-moe", 2, 2),
    ("tiny", 4, 1),
    ("tiny-vocab-250", 4, 1),
]


@pytest.mark.parametrize("name,tp,ep", CASES)
def test_the_spec_tiles_every_tensor_exactly(name, tp, ep):
    """For every tensor, the tp x ep ranks' boxes that are saved (tp replica 0) cover the padded whole
    tensor exactly once: their volumes add up to it and no two of them overlap."""
    m = model_preset(name.removesuffix("-vocab-250"))
    if name.endswith("-vocab-250"):
        m = dataclasses.replace(m, vocab_size=250)  # padded to 252 at tp4
    assert m.n_heads % tp == 0 and (not m.is_moe or m.n_experts % ep == 0)
    for spec in tensor_specs(m, tp=tp, ep=ep).values():
        padded = list(spec.shape)
        if spec.tp is not None and spec.tp.padded:
            padded[spec.tp.dim] = spec.tp.padded
        saved = []
        for tp_rank in range(tp):
            for ep_rank in range(ep if spec.ep is not None else 1):
                box = spec.local_box(tp_rank=tp_rank, ep_rank=ep_rank)
                if spec.tp_replica(tp_rank) == 0:
                    saved.append(box)
        assert sum(math.prod(sizes) for _, sizes in saved) == math.prod(padded), spec.name
        corners = {offsets for offsets, _ in saved}
        assert len(corners) == len(saved), spec.name  # equal-sized pieces: distinct corners, no overlap
        for offsets, sizes in saved:
            assert all(o + s <= p for o, s, p in zip(offsets, sizes, padded)), spec.name


def test_replicated_kv_heads_and_the_padded_vocabulary():
    """llama3-405b at tp16: 8 kv heads, so ranks 2j and 2j+1 hold kv head j (the second a replica);
    a 250-token vocabulary at tp4 is padded to 252, 63 rows a rank, the last rank's last 2 padding."""
    specs = tensor_specs(model_preset("llama3-405b"), tp=16)
    wk = specs["layers.0.attention.wk.weight"]
    assert [wk.local_box(tp_rank=r)[0][0] // 128 for r in range(4)] == [0, 0, 1, 1]
    assert [wk.tp_replica(r) for r in range(4)] == [0, 1, 0, 1]
    assert wk.local_shape == (128, 16384)
    small = dataclasses.replace(model_preset("tiny"), vocab_size=250)
    assert padded_vocab(small, 4) == 252
    emb = tensor_specs(small, tp=4)["tok_embeddings.weight"]
    assert emb.local_box(tp_rank=3) == ((189, 0), (63, small.dim))


def test_a_models_key_is_built_once_and_follows_its_fields():
    """`model_key` is built once per model (the planner's caches ask ~10^5 times a search); another
    model, even at a dead one's id, gets its own fields' key."""
    import dataclasses

    from fived.layout.stages import model_key, model_of

    m = model_preset("tiny")
    key = model_key(m)
    assert model_key(m) is key and model_of(key) == m and hash(key) == hash(tuple(key))
    other = dataclasses.replace(m, vocab_size=m.vocab_size + 64)
    assert model_key(other) != key and dict(model_key(other))["vocab_size"] == other.vocab_size
    assert type(m)(**vars(m)) == m  # (the key is kept outside the model: its __dict__ is its fields)
    for _ in range(50):  # (ids of dead models are reused: never their keys)
        n = model_preset("tiny")
        n_key = model_key(n)
        assert model_key(dataclasses.replace(n, dim=n.dim * 2)) != n_key
        del n
