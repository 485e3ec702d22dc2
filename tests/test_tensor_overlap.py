"""Tensor/sequence parallelism with its communication overlapped with the GEMMs (`parallel.tp_overlap`,
fived.parallel.tensor_overlap) on real gloo ranks: exact against the single-process reference with
every other dimension it composes with; the ledger shows the ring ran and equals the formula; the
activation memory is the plain path's."""

import pytest

from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import run_verify
from fived.training.report import expected_activation_bytes, expected_comm_bytes
from fived.training.trainer import run_training


def _verify(world, model="tiny", **over):
    cfg = tiny_config(model, train__steps=2, parallel__tp_overlap=True, **over)
    report = run_verify(cfg, world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tp", [2, 4])  # tp=4 > n_kv_heads=2: kv heads replicated
def test_overlapped_tensor_parallel_matches_reference(tp, sp, name):
    _verify(tp, name, parallel__dp=1, parallel__tp=tp, parallel__sp=sp)


@pytest.mark.parametrize("name, sp", [("tiny", True), ("tiny-moe", False)])
def test_with_data_parallel_zero1_and_microbatches(name, sp):
    _verify(4, name, parallel__dp=2, parallel__tp=2, parallel__sp=sp, parallel__zero=1, train__microbatches=2)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("sp", [False, True])
def test_with_activation_checkpointing(sp, mode):
    _verify(2, "tiny", parallel__dp=1, parallel__tp=2, parallel__sp=sp, train__activation_checkpointing=mode)


@pytest.mark.parametrize("sp", [False, True])
def test_with_pipeline_stages(sp):
    _verify(4, "tiny", parallel__dp=1, parallel__tp=2, parallel__pp=2, parallel__sp=sp, train__microbatches=2)


@pytest.mark.parametrize("schedule, virtual", [("interleaved-1f1b", 2), ("zero-bubble", 2), ("zbv", 1)])
def test_with_pipeline_schedules(schedule, virtual):
    """(zero-bubble and zbv split backward into input and weight gradients)"""
    _verify(
        4,
        "tiny",
        parallel__dp=1,
        parallel__tp=2,
        parallel__pp=2,
        parallel__sp=True,
        train__microbatches=2,
        parallel__pp_schedule=schedule,
        parallel__pp_virtual=virtual,
    )


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("sp", [False, True])
def test_split_backward_runs_each_tp_collective_once(sp, overlap):
    """zero-bubble's input and weight passes both reach a region's backward (and unpack its saved
    tensors): the overlapped regions compute only each pass's own gradients, the plain regions'
    re-gathered inputs serve both passes, so every tp collective runs as often (and moves as many
    bytes) as under interleaved-1f1b."""

    def tp_comm(schedule):
        cfg = tiny_config(
            "tiny",
            parallel__dp=1,
            parallel__tp=2,
            parallel__pp=2,
            parallel__sp=sp,
            train__steps=1,
            parallel__tp_overlap=overlap,
            train__microbatches=2,
            parallel__pp_schedule=schedule,
            parallel__pp_virtual=2,
        )
        return [
            {k: v for k, v in res.comm.items() if k.startswith("tp/")}
            for res in run_on_ranks(4, run_training, cfg, False, False)
        ]

    interleaved, split = tp_comm("interleaved-1f1b"), tp_comm("zero-bubble")
    assert all(ranks for ranks in interleaved) and split == interleaved


def test_with_context_parallel_and_zero3():
    _verify(4, "tiny", parallel__dp=1, parallel__cp=2, parallel__tp=2, parallel__sp=True, parallel__zero=3)


def test_with_compiled_blocks():
    _verify(
        2,
        "tiny",
        parallel__dp=1,
        parallel__tp=2,
        parallel__sp=True,
        train__compile=True,
        train__compile_backend="aot_eager",
    )


def _train(name, sp, overlap, **over):
    cfg = tiny_config(
        name, parallel__dp=1, parallel__tp=2, parallel__sp=sp, train__steps=1, parallel__tp_overlap=overlap, **over
    )
    return cfg, run_on_ranks(2, run_training, cfg, False, False)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("sp", [False, True])
def test_the_rings_ran_and_the_ledger_is_the_formula(sp, name):
    """Per overlapped region (attention, dense MLP) and micro-batch at tp=2: with SP three ring hops
    (input and output forward, output gradient backward) replace an all-gather and a reduce-scatter
    of the same bytes; without SP the output's all-reduce goes in 2 chunks. MoE regions stay plain."""
    for micro in (1, 2):
        _, plain = _train(name, sp, False, train__microbatches=micro)
        cfg, overlapped = _train(name, sp, True, train__microbatches=micro)
        m = cfg.model
        rings = micro * (2 * m.n_layers - sum(i >= m.n_dense_layers for i in range(m.n_layers)) * m.is_moe)
        for res in overlapped:
            assert {k: v["bytes"] for k, v in res.comm.items()} == expected_comm_bytes(cfg, 2)
            calls = {k: v["calls"] for k, v in res.comm.items()}
            before = {k: v["calls"] for k, v in plain[0].comm.items()}
            if sp:
                assert calls["tp/send"] == calls["tp/recv"] == 3 * rings
                # every byte the plain path moved, the overlapped one moves too (at tp=2)
                assert sum(v["bytes"] for v in res.comm.values()) == sum(v["bytes"] for v in plain[0].comm.values())
            else:
                assert "tp/send" not in calls and calls["tp/all_reduce"] == before["tp/all_reduce"] + rings
            # the async collectives ran under compute (the plain path has none on tp)
            assert res.breakdowns[-1]["overlapped"].get("tp", 0) > 0
        assert not plain[0].breakdowns[-1]["overlapped"].get("tp")


def test_ledger_with_checkpointing_tp4_and_autocast():
    """Recomputed blocks run their rings again; at tp=4 a ring is 3 hops of a quarter; under bf16
    autocast the overlapped region re-gathers its input in backward (the plain one's bf16 linears
    keep a gathered copy)."""
    # (dense under autocast: the plain MoE region's bytes under autocast + SP differ from the formula
    # without tp_overlap too)
    for name, mode, tp, dtype in (
        ("tiny-moe", "full", 2, "float64"),
        ("tiny-moe", "selective", 2, "float64"),
        ("tiny-moe", "none", 4, "float64"),
        ("tiny", "none", 2, "bfloat16-autocast"),
    ):
        cfg = tiny_config(
            name,
            parallel__dp=1,
            parallel__tp=tp,
            parallel__sp=True,
            train__steps=1,
            parallel__tp_overlap=True,
            train__activation_checkpointing=mode,
            train__dtype=dtype,
        )
        for res in run_on_ranks(tp, run_training, cfg, False, False):
            assert {k: v["bytes"] for k, v in res.comm.items()} == expected_comm_bytes(cfg, tp), mode


WIDE = {"model__dim": 128, "model__n_heads": 8, "model__n_kv_heads": 4, "model__ffn_dim": 256}


def test_activation_memory_is_the_plain_paths():
    """The overlapped region keeps its input's sequence shard (1/tp with SP) as the plain region's
    saved-tensor hook does: the bytes saved per layer are the formula's, with and without SP."""
    for tp, sp in [(2, False), (2, True), (4, True)]:
        cfg = tiny_config(
            "tiny",
            parallel__dp=1,
            parallel__tp=tp,
            parallel__sp=sp,
            train__steps=1,
            train__global_batch=4,
            parallel__tp_overlap=True,
            **WIDE,
        )
        for res in run_on_ranks(tp, run_training, cfg, False, False):
            layers = {k: v for k, v in res.activations.items() if k.isdigit()}
            assert layers and all(got == expected_activation_bytes(cfg, tp) for got in layers.values()), (tp, sp)
