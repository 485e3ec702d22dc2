"""Checkpoints of train.optimizer=muon runs on real gloo ranks: each Muon matrix's momentum buffer is
saved by canonical name, placed like its parameter, so a resumed run equals the uninterrupted one to
the last bit, and a checkpoint written by one layout continues at another exactly like one device."""

import pytest
import torch

from fived.checkpoint.checkpointer import find_checkpoint
from fived.checkpoint.dcp_io import tensor_shapes
from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import run_verify
from fived.training.trainer import run_training

STEPS = 4
MUON = {"train__optimizer": "muon"}

RESUMED = {  # (model, world, overrides): pieces as flat ranges, rows, tp halves, experts, stages
    "zero1-dp2-tp2": ("tiny-moe", 4, dict(parallel__dp=2, parallel__tp=2, parallel__zero=1)),
    "zero2-buckets": (
        "tiny-moe",
        4,
        dict(
            parallel__dp=4,
            parallel__zero=2,
            train__microbatches=2,
            parallel__overlap_grad_reduce=True,
            parallel__bucket_mb=3000 / 2**20,
        ),
    ),
    "zero3-hsdp": (
        "tiny-moe",
        4,
        dict(parallel__dp=4, parallel__dp_replicate=2, parallel__zero=3, model__router_bias_rate=0.01),
    ),
    "pp2-ep2": ("tiny-moe", 4, dict(parallel__pp=2, parallel__dp=2, parallel__ep=2, train__microbatches=2)),
    "zero2-bf16": ("tiny", 2, dict(parallel__dp=2, parallel__zero=2, train__dtype="bfloat16")),
    "ep2-muon-buckets": (
        "tiny-moe",
        4,
        dict(parallel__dp=4, parallel__ep=2, parallel__zero=1, train__muon_bucket_mb=2**14 / 2**20),
    ),  # (a few matrices each)
}


@pytest.mark.parametrize("layout", list(RESUMED))
def test_resume_is_bit_exact(layout, tmp_path):
    model, world, over = RESUMED[layout]
    cfg = tiny_config(model, train__steps=STEPS, **MUON, **over)
    whole = run_on_ranks(world, run_training, cfg, False, False, True)
    cfg.train.output_dir = str(tmp_path)
    first = run_on_ranks(world, run_training, cfg, True, False, False, None, STEPS // 2)
    checkpoint = find_checkpoint(tmp_path)
    second = run_on_ranks(world, run_training, cfg, True, False, True, str(checkpoint))
    resumed = first[0].metrics + second[0].metrics
    assert [m["loss"] for m in whole[0].metrics] == [m["loss"] for m in resumed]
    assert [m["grad_norm"] for m in whole[0].metrics] == [m["grad_norm"] for m in resumed]
    for name, value in whole[0].state.items():
        assert torch.equal(value, second[0].state[name]), name
    saved = tensor_shapes(checkpoint)  # Muon's state by canonical name, whole shapes; AdamW's for the rest
    assert (
        saved["optimizer.layers.0.attention.wq.weight.momentum_buffer"] == saved["model.layers.0.attention.wq.weight"]
    )
    assert "optimizer.layers.0.attention.wq.weight.exp_avg" not in saved
    assert "optimizer.tok_embeddings.weight.exp_avg_sq" in saved


def _world(over: dict) -> int:
    return (
        over.get("parallel__dp", 1)
        * over.get("parallel__tp", 1)
        * over.get("parallel__pp", 1)
        * over.get("parallel__cp", 1)
    )


MOE = {"model__name": "tiny-moe", "model__router_bias_rate": 0.01}
RESHARD = [  # (first half's layout, second half's, model): every kind of piece, both ways
    (dict(parallel__dp=4, parallel__zero=1), dict(parallel__tp=2, parallel__pp=2, train__microbatches=2), {}),
    (dict(parallel__tp=2, parallel__pp=2, train__microbatches=2), dict(parallel__dp=4, parallel__zero=3), {}),
    (
        dict(parallel__pp=2, parallel__dp=2, parallel__zero=3, parallel__ep=2, train__microbatches=2),
        dict(parallel__dp=4, parallel__ep=4, parallel__zero=2),
        MOE,
    ),
    (
        dict(parallel__cp=2, parallel__tp=2, parallel__sp=True),
        dict(parallel__dp=4, parallel__dp_replicate=2, parallel__zero=1),
        {},
    ),
]


def _pair_id(value) -> str:
    return "-".join(f"{k.split('__')[1]}{v}" for k, v in value.items()) or "tiny"


@pytest.mark.parametrize("first,second,model", RESHARD, ids=_pair_id)
def test_reshard_is_exact(first, second, model):
    model = {"model__name": "tiny", **model}
    a = tiny_config(train__steps=STEPS, **MUON, **model, **first)
    b = tiny_config(train__steps=STEPS, **MUON, **model, **second)
    report = run_verify(b, _world(second), printer=lambda *_: None, reshard_from=(a, _world(first)))
    assert len(report.rows) == STEPS
    assert report.max_relative_difference <= EXACT, report.max_rel
