"""ZeRO-2 reducing every micro-batch's gradients (parallel.zero2_reduce_every_microbatch) on real
gloo ranks: exact against one device in float64 (data parallel, HSDP, tensor parallel with SP, pipeline
schedules with and without a split backward), a reduce-scatter per bucket per micro-batch, bf16
gradients summed in float32, and the ledger's bytes equal to the planner's."""

import pytest
import torch

from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import run_verify
from fived.training.report import expected_comm_bytes, expected_state_bytes
from fived.training.trainer import run_training

SMALL_BUCKET_MB = 3000 / 2**20  # 3 kB: dozens of buckets in the tiny models
EVERY = dict(
    parallel__zero=2,
    parallel__overlap_grad_reduce=True,
    parallel__zero2_reduce_every_microbatch=True,
    parallel__bucket_mb=SMALL_BUCKET_MB,
)


def _quiet(*_):
    pass


@pytest.mark.parametrize(
    "world,over",
    [
        (2, dict(parallel__dp=2)),
        (4, dict(parallel__dp=4, parallel__overlap_param_gather=True)),
        (4, dict(parallel__dp=4, parallel__dp_replicate=2)),
        (4, dict(parallel__dp=2, parallel__tp=2, parallel__sp=True)),
        (4, dict(parallel__dp=2, parallel__pp=2, parallel__pp_schedule="1f1b")),
        (4, dict(parallel__dp=2, parallel__pp=2, parallel__pp_schedule="zbv")),
    ],
    ids=["dp2", "dp4-gather", "hsdp2x2", "dp2-tp2-sp", "pp2-1f1b-dp2", "pp2-zbv-dp2"],
)
def test_every_microbatch_matches_reference(world, over):
    """3 micro-batches (pipelines: 4), each reduce-scattered into the shard as backward completes
    its buckets: the losses, gradient norms and weights of 2 steps equal one device's in float64."""
    micro = 4 if "parallel__pp" in over else 3
    cfg = tiny_config(
        "tiny", train__steps=2, train__microbatches=micro, train__global_batch=12 if micro == 3 else 8, **EVERY, **over
    )
    report = run_verify(cfg, world, printer=_quiet)
    print(over, "max relative difference", report.max_relative_difference)
    assert report.max_relative_difference <= EXACT, report.max_rel


def _counted(cfg):
    """Train; the buckets, each reduction started (bucket, micro-batches whose backward had run), the most
    gradient elements any parameters held at a start, whether a whole gradient buffer ever existed, the result."""
    from fived.training.trainer import Trainer

    trainer = Trainer(cfg, log=False)
    dp = trainer.plan.data_parallel
    launched, backwards, held, whole = [], [0], [0], [False]
    original = dp.reducing._start

    def start(k):
        launched.append((k, backwards[0]))
        held[0] = max(held[0], sum(p.grad.numel() for p in dp.params if p.grad is not None))
        whole[0] |= dp.grad_buf is not None
        return original(k)

    dp.reducing._start = start
    before = dp.before_micro_batch
    dp.before_micro_batch = lambda is_last: backwards.__setitem__(0, backwards[0] + 1) or before(is_last)
    metrics = trainer.fit(progress=False)
    largest = max(b.piece for b in dp.buckets) * dp.shards
    return len(dp.buckets), launched, (held[0], largest, whole[0]), trainer.result(metrics)


def test_a_reduce_scatter_per_bucket_per_microbatch():
    """Every bucket reduce-scatters once per micro-batch, during that micro-batch's backward (before
    the next one starts), last bucket first, with no whole gradient buffer (the gradients held at any
    start: within the two largest buckets the planner prices); the ledger's calls, bytes and model
    state equal the planner's."""
    cfg = tiny_config("tiny", parallel__dp=4, train__microbatches=3, train__steps=1, train__global_batch=12, **EVERY)
    for rank, (buckets, launched, (held, largest, whole), res) in enumerate(run_on_ranks(4, _counted, cfg)):
        assert not whole and 0 < held <= 2 * largest
        assert buckets >= 10
        order = list(range(buckets - 1, -1, -1))
        assert launched == [(k, m) for m in (1, 2, 3) for k in order]  # (m: during micro-batch m's backward)
        assert res.comm["dp/reduce_scatter_single"]["calls"] == 3 * buckets
        assert {k: v["bytes"] for k, v in res.comm.items()} == expected_comm_bytes(cfg, 4)
        assert res.memory == expected_state_bytes(cfg, 4, rank=rank)


def _accumulators(cfg):
    from fived.training.trainer import Trainer

    trainer = Trainer(cfg, log=False)
    dp = trainer.plan.data_parallel
    seen = []
    original = dp.reducing.accumulator

    def accumulator():
        acc = original()
        seen.append(acc.dtype)
        return acc

    dp.reducing.accumulator = accumulator
    trainer.fit(progress=False)
    return set(seen), dp.shard_grad.dtype


def test_bf16_sums_microbatches_in_float32():
    """bf16 weights and gradients: each micro-batch's reduced pieces add into a float32 accumulator
    (not the bf16 shard), and the run trains like the one reducing after the last micro-batch (which
    sums the micro-batches in bf16 first) to bf16 precision."""
    base = dict(parallel__dp=2, train__microbatches=3, train__global_batch=12, train__steps=2, train__dtype="bfloat16")
    cfg = tiny_config("tiny", **base, **EVERY)
    for dtypes, shard_dtype in run_on_ranks(2, _accumulators, cfg):
        assert dtypes == {torch.float32} and shard_dtype == torch.bfloat16
    every = run_on_ranks(2, run_training, cfg, False, False)[0]
    once = run_on_ranks(
        2,
        run_training,
        tiny_config("tiny", **base, **{**EVERY, "parallel__zero2_reduce_every_microbatch": False}),
        False,
        False,
    )[0]
    for a, b in zip(every.metrics, once.metrics):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)
