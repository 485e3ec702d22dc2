"""Expert parallelism on real gloo ranks: exact against the single-process reference with every
ZeRO stage, context parallelism and aux-loss-free balancing; all-to-all bytes against the formula."""

import pytest

from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import run_verify
from fived.training.trainer import run_training


def _verify(world, **over):
    over.setdefault("train__steps", 2)
    report = run_verify(tiny_config("tiny-moe", **over), world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel
    return report


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_parallel_matches_reference(zero, ep):
    _verify(4, parallel__dp=4, parallel__ep=ep, parallel__zero=zero, train__microbatches=2)


def test_with_context_parallel():
    _verify(4, parallel__dp=2, parallel__cp=2, parallel__ep=4)


def test_aux_loss_free_balancing_is_layout_invariant_and_acts():
    base = tiny_config("tiny-moe", parallel__dp=1, train__steps=3)
    plain = run_on_ranks(1, run_training, base, False, False)[0].metrics
    report = _verify(4, parallel__dp=4, parallel__ep=2, model__router_bias_rate=0.05, train__steps=3)
    assert report.rows[-1]["loss"][0] != plain[-1]["loss"]  # the bias really changed the routing


def test_all_to_all_bytes_are_the_formula():
    """Per MoE layer and micro-batch, over an ep group: the expert counts (E int64 per rank) and
    four token exchanges (dispatch and combine, forward and backward) each carrying every routed
    slot once: ep*E*8 + 4*ep*T*k*h*e bytes, T tokens per rank."""
    for ep in (2, 4):
        cfg = tiny_config("tiny-moe", parallel__dp=ep, parallel__ep=ep, train__steps=1, train__global_batch=8)
        results = run_on_ranks(ep, run_training, cfg, False, False)
        m, t = cfg.model, cfg.train
        tokens = t.global_batch // ep * t.seq_len
        want = m.n_layers * (ep * m.n_experts * 8 + 4 * ep * tokens * m.top_k * m.dim * 8)
        got = sum(v["bytes"] for r in results for k, v in r.comm.items() if k.endswith("/all_to_all_single"))
        assert got == want
        assert "expert_load_max_over_mean" in results[0].metrics[0]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_memory_with_experts_and_context(zero):
    """Per-rank bytes equal fived.training.report's formula: experts E/ep per rank, sharded over edp by ZeRO-3
    only; the rest ZeRO-sharded over dp_shard x cp."""
    from fived.training.report import expected_state_bytes

    cfg = tiny_config("tiny-moe", parallel__dp=2, parallel__cp=2, parallel__ep=2, parallel__zero=zero, train__steps=1)
    for res in run_on_ranks(4, run_training, cfg, False, False):
        assert res.memory == pytest.approx(expected_state_bytes(cfg, 4), abs=4 * 2 * 8)
