"""Tensor and sequence parallelism on real gloo ranks: exact against the single-process reference;
activation memory, communication and model-state bytes measured by the ledger equal the formulas."""

import pytest

from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import run_verify
from fived.training.report import expected_activation_bytes, expected_comm_bytes, expected_state_bytes
from fived.training.trainer import run_training


def _verify(world, model="tiny", **over):
    report = run_verify(tiny_config(model, train__steps=2, **over), world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tp", [2, 4])  # tp=4 > n_kv_heads=2: kv heads replicated
def test_tensor_parallel_matches_reference(tp, sp, name):
    _verify(tp, name, parallel__dp=1, parallel__tp=tp, parallel__sp=sp)


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("sp", [False, True])
def test_with_activation_checkpointing(sp, mode):
    _verify(2, "tiny-moe", parallel__dp=1, parallel__tp=2, parallel__sp=sp, train__activation_checkpointing=mode)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_with_data_parallel_and_zero(zero):
    _verify(
        4, "tiny-moe", parallel__dp=2, parallel__tp=2, parallel__sp=True, parallel__zero=zero, train__microbatches=2
    )


@pytest.mark.parametrize("tp, sp, tied", [(4, False, False), (2, True, True)])
def test_vocabulary_not_divisible_by_tp(tp, sp, tied):
    """Padded vocab rows/columns are masked: the loss is exactly the one-device loss."""
    _verify(
        tp,
        "tiny",
        parallel__dp=1,
        parallel__tp=tp,
        parallel__sp=sp,
        model__vocab_size=258 + tp // 4,
        model__tie_embeddings=tied,
    )


WIDE = {"model__dim": 128, "model__n_heads": 8, "model__n_kv_heads": 4, "model__ffn_dim": 256}


def _run(tp, sp, shape, **over):
    cfg = tiny_config(
        "tiny", parallel__dp=1, parallel__tp=tp, parallel__sp=sp, train__steps=1, train__global_batch=4, **shape, **over
    )
    return cfg, run_on_ranks(tp, run_training, cfg, False, False)


@pytest.mark.parametrize("shape", [{}, WIDE], ids=["tiny", "wide"])
def test_activation_memory_is_the_formula(shape):
    measured = {}
    for tp, sp in [(1, False), (2, False), (2, True), (4, False), (4, True)]:
        cfg, results = _run(tp, sp, shape)
        for res in results:
            for layer, got in ((k, v) for k, v in res.activations.items() if k.isdigit()):
                assert got == expected_activation_bytes(cfg, tp), (tp, sp, layer)
        measured[tp, sp] = results[0].activations["0"]
    base = measured[1, False]
    for tp in (2, 4):
        if shape or tp == 2:  # (tiny at tp=4 keeps one of its 2 kv heads per rank: not 1/T)
            assert measured[tp, True] == pytest.approx(base / tp, rel=0.05)
        # without SP the norms' part stays whole on every rank
        assert measured[tp, False] > 1.3 * base / tp


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("sp", [False, True])
def test_communication_and_state_are_the_formulas(sp, name):
    for micro in (1, 2):
        cfg = tiny_config(
            name, parallel__dp=1, parallel__tp=2, parallel__sp=sp, train__steps=1, train__microbatches=micro
        )
        results = run_on_ranks(2, run_training, cfg, False, False)
        for res in results:
            assert {k: v["bytes"] for k, v in res.comm.items()} == expected_comm_bytes(cfg, 2)
            assert res.memory == expected_state_bytes(cfg, 2)


def test_tp_layer_traffic_per_layer():
    """Per layer and micro-batch: two all-reduces of b*s*h forward and two backward; with SP the same
    bytes as all-gathers plus reduce-scatters (plus the backward re-gather of region inputs)."""
    cfg, one = _run(2, False, {}, model__n_layers=1)
    _, two = _run(2, False, {}, model__n_layers=2)
    act = 4 * 32 * 64 * 8  # b*s*h float64
    layer = two[0].comm["tp/all_reduce"]["bytes"] - one[0].comm["tp/all_reduce"]["bytes"]
    assert layer == 4 * act
    _, one_sp = _run(2, True, {}, model__n_layers=1)
    _, two_sp = _run(2, True, {}, model__n_layers=2)
    gathered = two_sp[0].comm["tp/all_gather_single"]["bytes"] - one_sp[0].comm["tp/all_gather_single"]["bytes"]
    scattered = (
        two_sp[0].comm["tp/reduce_scatter_single"]["bytes"] - one_sp[0].comm["tp/reduce_scatter_single"]["bytes"]
    )
    assert gathered == 6 * act and scattered == 4 * act  # 2 AG + 2 RS forward, 2 RS + 2 AG backward, 2 re-gathers


@pytest.mark.parametrize(
    "name, over",
    [
        ("tiny", {"model__qk_norm": True}),
        ("tiny", {"parallel__tp": 4}),  # 4 > n_kv_heads=2: kv heads' gradients summed in slots
        ("tiny", {"model__qk_norm": True, "parallel__sp": True, "model__tie_embeddings": True}),
        ("tiny-moe", {"model__qk_norm": True, "parallel__sp": True, "parallel__etp": 1}),
    ],
    ids=["qk_norm", "kv-replicated", "qk_norm-sp-tied", "moe-shared-qk_norm-sp-folded"],
)
def test_communication_of_every_model_feature_is_the_planners(name, over):
    """Every tensor kind whose gradient is summed over tp (norm gains under SP, q/k-norm weights, the
    routers, whole experts folded over tp) and every model feature: the ledger's bytes are the
    planner's, which reads them from the sharding spec (no hand list to leave one out)."""
    cfg = tiny_config(name, **{"parallel__dp": 1, "parallel__tp": 2, "train__steps": 1, **over})
    world = cfg.parallel.tp
    results = run_on_ranks(world, run_training, cfg, False, False)
    for rank, res in enumerate(results):
        assert {k: v["bytes"] for k, v in res.comm.items()} == expected_comm_bytes(cfg, world, rank), rank
