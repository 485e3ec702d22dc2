"""parallel.ep_overlap on real gloo ranks: exact against the single-process reference across layouts;
the exchanges really run in chunks, asynchronously, under the other chunk's GEMMs (forward and
backward); the ledger's bytes are the planner's formula."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fived.layout.layout import EP_OVERLAP_CHUNKS
from fived.parallel import comm
from fived.parallel.expert import ExpertParallelExperts
from fived.parallel.expert_overlap import chunk_order, chunk_share
from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import compare, run_layout, run_verify
from fived.training.report import expected_comm_bytes
from fived.training.trainer import run_training

LAYOUTS = {
    "ep2": (2, dict(parallel__dp=2, parallel__ep=2)),
    "ep4-zero1-micro2": (4, dict(parallel__dp=4, parallel__ep=4, parallel__zero=1, train__microbatches=2)),
    "ep2-zero3": (4, dict(parallel__dp=4, parallel__ep=2, parallel__zero=3)),
    "dp2-tp2-sp-ep2": (4, dict(parallel__dp=2, parallel__tp=2, parallel__sp=True, parallel__ep=2)),
    "pp2-dp2-ep2-micro2": (4, dict(parallel__pp=2, parallel__dp=2, parallel__ep=2, train__microbatches=2)),
    # (a schedule that splits backward: input gradients first, the weights' later)
    "pp2-zbv-dp2-ep2-micro4": (
        4,
        dict(parallel__pp=2, parallel__dp=2, parallel__ep=2, train__microbatches=4, parallel__pp_schedule="zbv"),
    ),
    "cp2-ep2": (4, dict(parallel__dp=2, parallel__cp=2, parallel__ep=2)),
    "ep2-full-checkpointing": (2, dict(parallel__dp=2, parallel__ep=2, train__activation_checkpointing="full")),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_overlapped_expert_parallel_matches_reference(name):
    world, over = LAYOUTS[name]
    cfg = tiny_config("tiny-moe", parallel__ep_overlap=True, train__steps=2, **over)
    report = run_verify(cfg, world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel


def test_with_capacity_dropping_same_as_without_overlap():
    """Dropping is per local micro-batch (layout-dependent, so not held to the one-process
    reference): overlapped and plain EP drop the same slots and train alike. (Capacity 0.5 holds
    half of the routed slots: some are always dropped.)"""
    plain = tiny_config("tiny-moe", parallel__dp=2, parallel__ep=2, model__capacity_factor=0.5, train__steps=2)
    overlapped = tiny_config(
        "tiny-moe",
        parallel__dp=2,
        parallel__ep=2,
        model__capacity_factor=0.5,
        train__steps=2,
        parallel__ep_overlap=True,
    )
    report = compare(run_layout(plain, 2)[0], run_layout(overlapped, 2)[0])
    assert report.max_relative_difference <= EXACT, report.max_rel


def test_chunks_split_every_expert_as_the_counts_say():
    counts = torch.tensor([0, 1, 2, 3, 7, 0, 5])
    order = chunk_order(counts, 3)
    expert = torch.repeat_interleave(torch.arange(7), counts)
    shares = [chunk_share(counts, k, 3) for k in range(3)]
    assert [chunk_share(7, k, 3) for k in range(3)] == [2, 2, 3] and torch.equal(sum(shares), counts)
    assert sorted(order.tolist()) == list(range(int(counts.sum())))
    for share, rows in zip(shares, order.split([int(s.sum()) for s in shares])):
        assert torch.equal(torch.bincount(expert[rows], minlength=7), share)
        assert rows.tolist() == sorted(rows.tolist())  # still sorted by expert, token order kept


class _GemmMarks(TorchDispatchMode):
    """Counts the expert GEMM ops (forward and backward) as they run: the recorder's clock."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._opname.startswith("grouped_swiglu"):
            self.ops.append(func._opname)
        return func(*args, **(kwargs or {}))


def _one_layer(chunks: int):
    """One expert-parallel layer forward and backward on this rank's random slots; its outputs and
    gradients, and per all-to-all (issue, wait) as counts of expert GEMMs run by then."""
    rank, ep, n_experts, dim = dist.get_rank(), dist.get_world_size(), 4, 8
    gen = torch.Generator().manual_seed(rank)
    layer = ExpertParallelExperts(n_experts, dim, 16, dist.group.WORLD, ep, overlap_chunks=chunks).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    counts = torch.bincount(torch.randint(0, n_experts, (29 + rank,), generator=gen), minlength=n_experts)
    x = torch.randn(int(counts.sum()), dim, generator=gen, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    gemms = _GemmMarks()
    recorder = comm.CommRecorder({dist.group.WORLD: "ep"}, clock=lambda: len(gemms.ops))
    with comm.recording(recorder), gemms:
        y = layer(x, counts)
        (y * upstream).sum().backward()
    marks = [(e.issued, e.wait_start) for e in recorder.events]
    return y.detach(), x.grad, [p.grad for p in layer.parameters()], marks, gemms.ops


def test_exchanges_run_under_the_other_chunks_gemms():
    """Per layer and micro-batch: one counts exchange (blocking), then 4 exchanges x 2 chunks, all
    asynchronous. Forward: chunk 1's dispatch travels under chunk 0's GEMMs, chunk 0's combine
    under chunk 1's; backward (autograd's order): chunk 0's combine gradient under chunk 1's GEMM
    backward, chunk 1's dispatch gradient under chunk 0's. Same results as the plain path."""
    assert EP_OVERLAP_CHUNKS == 2
    plain, overlapped = run_on_ranks(2, _one_layer, 1), run_on_ranks(2, _one_layer, 2)
    for (y0, dx0, dw0, _, _), (y1, dx1, dw1, marks, ops) in zip(plain, overlapped):
        assert (y1 - y0).abs().max() <= EXACT * y0.abs().max()
        assert (dx1 - dx0).abs().max() <= EXACT * dx0.abs().max()
        for a, b in zip(dw0, dw1):
            assert (b - a).abs().max() <= EXACT * a.abs().max()
        assert ops == ["grouped_swiglu"] * 2 + ["grouped_swiglu_backward"] * 2
        assert marks[0][1] is None  # the counts: blocking
        # (issued, waited) in GEMMs run: fwd dispatch 0, 1, combine 0, 1; bwd combine 1, 0, dispatch 1, 0
        assert marks[1:] == [(0, 0), (0, 1), (1, 2), (2, 2), (2, 2), (2, 3), (3, 4), (4, 4)]


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_async_calls_and_bytes_are_the_formula(checkpointing):
    """The ledger's ep bytes with the switch on: those of the plain path and, summed over the ep
    group (a rank's combine carries what its experts received: balanced only over the group), of
    the planner's formula; the calls: per MoE layer and micro-batch one counts exchange and 4 x 2
    chunks, forward ones again when full checkpointing recomputes them."""
    common = dict(
        parallel__dp=2,
        parallel__ep=2,
        train__steps=1,
        train__microbatches=2,
        train__activation_checkpointing=checkpointing,
    )
    cfg, plain = tiny_config("tiny-moe", parallel__ep_overlap=True, **common), tiny_config("tiny-moe", **common)
    on, off = run_on_ranks(2, run_training, cfg, False, False), run_on_ranks(2, run_training, plain, False, False)
    key = "dp/all_to_all_single"  # (the ep group holds dp's ranks: the ledger names it dp)
    assert sum(r.comm[key]["bytes"] for r in on) == sum(expected_comm_bytes(cfg, 2, rank)[key] for rank in range(2))
    per_step = (cfg.model.n_layers - cfg.model.n_dense_layers) * cfg.train.microbatches
    for res, ref in zip(on, off):
        assert res.comm[key]["bytes"] == ref.comm[key]["bytes"]
        fwd = 2 if checkpointing == "full" else 1  # (counts, dispatch and combine run again)
        assert res.comm[key]["calls"] == per_step * (fwd + (fwd + 1) * 2 * EP_OVERLAP_CHUNKS)
        assert ref.comm[key]["calls"] == per_step * (fwd + (fwd + 1) * 2)


def test_switch_is_a_no_op_without_expert_parallelism():
    """ep = 1: no all-to-all at all, the same collectives as with the switch off."""
    on = tiny_config("tiny-moe", parallel__dp=2, parallel__ep_overlap=True, train__steps=1)
    off = tiny_config("tiny-moe", parallel__dp=2, train__steps=1)
    with_switch = run_on_ranks(2, run_training, on, False, False)
    without = run_on_ranks(2, run_training, off, False, False)
    assert with_switch[0].comm == without[0].comm
    assert not any(k.endswith("all_to_all_single") for k in with_switch[0].comm)
    assert with_switch[0].metrics[0]["loss"] == without[0].metrics[0]["loss"]
