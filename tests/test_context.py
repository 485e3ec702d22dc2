"""Context parallelism (load-balanced ring attention, Ulysses, hybrid) on real gloo ranks: exact
against the single-process reference alone and composed with every other built dimension; activation
memory and the ring's K/V traffic measured by the ledger against their formulas. (With document
masking: tests/test_documents.py.)"""

import pytest
import torch

from fived.parallel.context import local_positions
from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import run_verify
from fived.training.trainer import run_training


def _verify(world, model, **over):
    report = run_verify(tiny_config(model, train__steps=2, **over), world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel


def test_load_balanced_chunks():
    assert local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([local_positions(32, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(32))
    # causal work (keys visible to each query) is the same on every rank
    work = [int((local_positions(32, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_matches_reference(cp, name):
    _verify(cp, name, parallel__dp=1, parallel__cp=cp)


@pytest.mark.parametrize(
    "over",
    [
        dict(parallel__dp=2, parallel__tp=2, parallel__cp=2, parallel__sp=True),
        dict(parallel__dp=2, parallel__cp=2, parallel__zero=3),
        dict(parallel__dp=1, parallel__cp=2, parallel__pp=2, train__microbatches=2),
        dict(parallel__dp=1, parallel__cp=2, parallel__tp=2, train__activation_checkpointing="full"),
    ],
    ids=["dp-tp-sp", "dp-zero3", "pp", "tp-checkpointing"],
)
def test_composes(over):
    world = over["parallel__dp"] * over.get("parallel__tp", 1) * over["parallel__cp"] * over.get("parallel__pp", 1)
    _verify(world, "tiny-moe", **over)


@pytest.mark.parametrize(
    "name,cp,mode", [("tiny-moe", 2, "ulysses"), ("tiny", 4, "ulysses"), ("tiny-moe", 4, "hybrid")]
)
def test_ulysses_and_hybrid_match_reference(name, cp, mode):
    """cp_mode ulysses (4 ranks: the 2 kv heads repeated) and hybrid (Ulysses pairs, a ring across)."""
    _verify(cp, name, parallel__dp=1, parallel__cp=cp, parallel__cp_mode=mode)


@pytest.mark.parametrize(
    "over",
    [
        dict(
            parallel__dp=1,
            parallel__cp=2,
            parallel__tp=2,
            parallel__sp=True,
            parallel__cp_mode="ulysses",
            train__activation_checkpointing="selective",
        ),
        dict(parallel__dp=2, parallel__cp=2, parallel__zero=3, parallel__cp_mode="ulysses"),
    ],
    ids=["tp-sp-selective", "dp-zero3"],
)
def test_ulysses_composes(over):
    _verify(4, "tiny-moe", **over)


def _run(cp, **over):
    cfg = tiny_config(
        "tiny", parallel__dp=1, parallel__cp=cp, train__steps=1, train__global_batch=4, train__seq_len=64, **over
    )
    return cfg, run_on_ranks(cp, run_training, cfg, False, False)


def test_activation_memory_divides_by_cp():
    _, one = _run(1)
    base = one[0].activations["0"]
    for cp in (2, 4):
        _, res = _run(cp)
        for r in res:
            assert r.activations["0"] == pytest.approx(base / cp, rel=0.10), cp


def test_ring_traffic_is_the_formula():
    """Per layer and micro-batch, each rank sends and receives: forward (cp-1) x (K, V);
    backward (cp-1) x (K, V, dK, dV) and a last hop of (dK, dV). (The chunk layout fixes which
    block each step computes, so no positions travel.)"""
    for cp in (2, 4):
        cfg, res = _run(cp)
        m, t = cfg.model, cfg.train
        s_local = t.seq_len // cp
        kv = t.global_batch * m.n_kv_heads * s_local * m.head_dim * 8  # float64
        per_layer = (cp - 1) * 2 * kv + (cp - 1) * 4 * kv + 2 * kv
        for r in res:
            assert r.comm["cp/send"]["bytes"] == m.n_layers * per_layer
            assert r.comm["cp/recv"]["bytes"] == m.n_layers * per_layer
