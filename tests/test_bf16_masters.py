"""bf16 runs keep float32 master weights: an update too small for a bf16 weight still moves them.

tests/test_zero.py::test_bf16_tracks_float32 compares losses, which cannot tell a run without masters
from one with them: with the masters rounded to bf16 after every step its bf16 run still ended 1.2%
from float32's loss (2.676 against 2.644), inside its 2%. Here the learning rate is so small that
almost no AdamW update (about lr per element) reaches half a bf16 ulp of its weight: a run whose
optimizer lost the float32 digits keeps its weights where they started, a run with masters moves
them as float32 does."""

import torch

from fived.layout.layout import masters_apart
from fived.model.init import init_value
from fived.testing import run_on_ranks, tiny_config
from fived.training.trainer import run_training

# AdamW moves an element by about lr a step; half a bf16 ulp is 2^-9 of the weight or more, so an
# element of magnitude above ~500 lr stays put in bf16: at 1e-6 nearly all of the tiny model's (std 0.02).
TINY_LR = 1e-6
RUNS = [("float32", 1)] + [("bfloat16", zero) for zero in (0, 1, 2, 3)]


def _train_each(cfgs):
    """Every configuration in turn in this one launch of ranks; the final parameters of each (in bf16
    runs with masters apart: the masters, as `ParallelPlan.full_state` reads what the optimizer updates)."""
    return [run_training(cfg, False, False, True).state for cfg in cfgs]


def _norm(tensors) -> float:
    return sum(t.double().square().sum() for t in tensors).sqrt().item()


def test_bf16_masters_hold_updates_below_bf16_resolution():
    """Three steps at lr 1e-6 on 2 ranks at every ZeRO stage of the bf16 path (masters apart, and
    sharded at ZeRO-1/2; at ZeRO-3 FSDP2's float32 shards are the masters): each bf16 run's weights
    move from their start as the float32 run's do (measured: 4% of float32's movement off). It
    catches masters missing or rounded to bf16 after a step, which the losses cannot show: the
    weights then stay where they started (99% off; at ZeRO-3, rounding the float32 shards moves them
    14 times float32's movement away)."""
    cfgs = [
        tiny_config(
            "tiny",
            train__dtype=dtype,
            parallel__dp=2,
            parallel__zero=zero,
            train__lr=TINY_LR,
            train__lr_schedule="constant",
            train__warmup_steps=0,
            train__global_batch=4,
            train__seq_len=16,
        )
        for dtype, zero in RUNS
    ]
    finals = run_on_ranks(2, _train_each, cfgs)[0]
    model, seed = cfgs[0].model, cfgs[0].train.seed
    start = {name: init_value(name, value.shape, model, seed) for name, value in finals[0].items()}
    moved = {name: finals[0][name] - start[name] for name in start}
    # The premise: float32's movement is (nearly all) below bf16's resolution, so without masters
    # a bf16 run could not follow it (measured: 9% of the elements would change in bf16).
    visible = sum((start[n] + moved[n]).bfloat16().ne(start[n].bfloat16()).sum().item() for n in start)
    assert visible / sum(t.numel() for t in start.values()) < 0.2
    off = {}  # per ZeRO stage: |bf16's movement - float32's| / |float32's|
    for (dtype, zero), final in zip(RUNS[1:], finals[1:]):
        # the masters start from the bf16 parameters, FSDP2's float32 shards from the float32 values
        begin = {n: t.bfloat16().float() if masters_apart(dtype, zero) else t for n, t in start.items()}
        off[zero] = round(_norm(final[n].float() - begin[n] - moved[n] for n in start) / _norm(moved.values()), 3)
    print("bf16's movement off float32's, per ZeRO stage:", off)
    assert all(part < 0.25 for part in off.values()), off
    for final in finals[1:]:  # (what the checkpoints hold too)
        assert all(t.dtype == torch.float32 for t in final.values())
