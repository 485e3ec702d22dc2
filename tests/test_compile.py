"""train.compile: every transformer block compiled on its own, composed with tensor + sequence
parallelism, pipeline stages, context parallelism (ring attention) and activation checkpointing;
each layout exact against the eager one-process reference in float64. The test uses the cheap
aot_eager backend (AOT autograd traces forward and backward; no code generation, seconds instead of
20-30 s per graph); the default inductor backend is run by bench_compile.py."""

import pytest
from torch._dynamo.eval_frame import OptimizedModule

from fived.config import ConfigError, build_config
from fived.layout.rules import check_config
from fived.model.transformer import build_model, canonical_name
from fived.parallel.compile import apply_compile
from fived.testing import EXACT, tiny_config
from fived.tools.verification import reference_config, run_verify

LAYOUTS = {
    "tp-sp full checkpointing": (
        2,
        dict(parallel__dp=1, parallel__tp=2, parallel__sp=True, train__activation_checkpointing="full"),
    ),
    "pp 1f1b": (2, dict(parallel__dp=1, parallel__pp=2, train__microbatches=2)),
    "cp selective checkpointing": (
        2,
        dict(parallel__dp=1, parallel__cp=2, train__activation_checkpointing="selective"),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_eager_reference(name):
    world, over = LAYOUTS[name]
    cfg = tiny_config("tiny", train__steps=2, train__compile=True, train__compile_backend="aot_eager", **over)
    assert not reference_config(cfg).train.compile  # the reference is the eager model
    report = run_verify(cfg, world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel


def test_every_block_is_compiled_and_names_are_kept():
    cfg = tiny_config("tiny")
    model = build_model(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    apply_compile(model, "aot_eager")
    assert all(isinstance(b, OptimizedModule) for b in model.layers.values())
    assert [canonical_name(n) for n, _ in model.named_parameters()] == names


def test_unknown_backend_is_one_line():
    with pytest.raises(ConfigError) as e:  # (an unknown choice: refused as the config is built)
        cfg = build_config(overrides={"model.name": "tiny", "train.compile": True, "train.compile_backend": "tensorrt"})
        check_config(cfg, 1)
    with pytest.raises(ConfigError) as built:  # (and one set in Python: by the checks before launch)
        cfg = build_config(overrides={"model.name": "tiny", "train.compile": True})
        cfg.train.compile_backend = "tensorrt"  # type: ignore[assignment]
        check_config(cfg, 1)
    assert built.value.field == "train.compile_backend" and "\n" not in str(built.value)
    assert e.value.field == "train.compile_backend" and "\n" not in str(e.value)
