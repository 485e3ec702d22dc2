"""Routed experts' gradients summed over edp during backward (parallel.overlap_grad_reduce, ZeRO-0/1/2
with ep > 1 and edp > 1; `fived.parallel.expert_grads`) on real gloo ranks: exact against one device
in float64, and each MoE layer's all-reduce really started by backward, not by the wait after it."""

import pytest
import torch

from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import compare, reference_config, reference_run, run_verify

OVERLAP = dict(parallel__overlap_grad_reduce=True, train__steps=2)


def _quiet(*_):
    pass


@pytest.mark.parametrize(
    "over",
    [
        dict(parallel__zero=0, parallel__dp=4, parallel__ep=2, train__microbatches=2),
        dict(parallel__zero=1, parallel__dp=4, parallel__ep=2, train__microbatches=2),
        dict(parallel__zero=2, parallel__dp=4, parallel__ep=2, train__microbatches=2),
        # folded (MoE parallel folding): ep and edp span the tp ranks
        dict(parallel__zero=1, parallel__dp=2, parallel__tp=2, parallel__sp=True, parallel__etp=1, parallel__ep=2),
    ],
    ids=["zero0", "zero1", "zero2", "folded-tp2-sp"],
)
def test_overlapped_expert_reduction_matches_reference(over):
    report = run_verify(tiny_config("tiny-moe", **OVERLAP, **over), 4, printer=_quiet)
    assert report.max_relative_difference <= EXACT, report.max_rel


def _launches(cfg):
    """Train; return the MoE layers this rank reduces, each launch (layer, while a backward was
    armed), whether each edp all-reduce of the last step was asynchronous (waited for after it was
    issued, not blocking in the call), the result with the whole parameters."""
    from fived.training.trainer import Trainer

    trainer = Trainer(cfg, log=False)
    reducing = trainer.plan.data_parallel.expert_reductions()
    assert reducing is not None
    launched = []
    start = reducing._start
    reducing._start = lambda params: launched.append((reducing.next, reducing.armed)) or start(params)
    metrics = trainer.fit(progress=False)
    edp = [e.wait_start is not None for e in trainer.timer.recorder.events if e.dim == "edp"]
    result = trainer.result(metrics, return_state=True)
    return len(reducing.layers), launched, edp, result


def _check_launches(cfg, world):
    reference = reference_run(reference_config(cfg))
    for layers, launched, edp, result in run_on_ranks(world, _launches, cfg):
        report = compare(reference, result)
        assert report.max_relative_difference <= EXACT, report.max_rel
        assert layers >= 2
        # every step: each layer once, last first, each started by backward (an autograd hook or the
        # end of a stage's last weight pass), none left to the wait in reduce_gradients
        assert launched == [(k, True) for k in range(layers)] * cfg.train.steps
        # (the last step's ledger) one asynchronous all-reduce per expert tensor (float64: in place), over edp
        assert result.comm["edp/all_reduce"]["calls"] == 3 * layers == len(edp) and all(edp)


def run_training_state(cfg):
    from fived.training.trainer import run_training

    return run_training(cfg, False, False, True)


@pytest.mark.parametrize("zero", [0, 2])
def test_expert_reduction_starts_during_backward(zero):
    cfg = tiny_config("tiny-moe", parallel__zero=zero, parallel__dp=4, parallel__ep=2, train__microbatches=2, **OVERLAP)
    _check_launches(cfg, 4)


def test_expert_reduction_under_split_backward_pipeline():
    """zbv: the weight passes accumulate without autograd's hooks; each stage's last one marks its
    experts' gradients done, inside the schedule. Exact, and every layer launched there."""
    cfg = tiny_config(
        "tiny-moe",
        parallel__zero=1,
        parallel__pp=2,
        parallel__dp=4,
        parallel__ep=2,
        parallel__pp_schedule="zbv",
        train__microbatches=2,
        **OVERLAP,
    )
    _check_launches(cfg, 8)


def test_without_the_switch_experts_reduce_after_backward():
    """Without overlap_grad_reduce nothing is built: the one blocking call after backward, as before."""
    cfg = tiny_config("tiny-moe", parallel__dp=4, parallel__ep=2, train__steps=1)
    for built in run_on_ranks(4, _built, cfg):
        assert built is None


def _built(cfg):
    from fived.training.trainer import Trainer

    trainer = Trainer(cfg, log=False)
    trainer.fit(progress=False)
    return trainer.plan.data_parallel.expert_reducing


def test_bf16_overlapped_experts_equal_the_blocking_reduction(monkeypatch):
    """bf16 expert gradients summed in float32 pieces of 1000 elements (dozens per layer, two in
    flight, copied back once reduced) during backward: over edp 2 a sum is one addition, and ZeRO-0's
    dense buckets do not depend on the switch, so the run equals the blocking one bit for bit."""
    import fived.parallel.expert_grads

    cfg = tiny_config(
        "tiny-moe", parallel__dp=4, parallel__ep=2, train__dtype="bfloat16", train__steps=2, train__microbatches=2
    )
    blocking = run_on_ranks(4, run_training_state, cfg)[0]
    monkeypatch.setattr(fived.parallel.expert_grads, "REDUCE_CHUNK_ELEMENTS", 1000)
    cfg.parallel.overlap_grad_reduce = True
    overlapped = run_on_ranks(4, run_training_state, cfg)[0]
    metrics = [(m["loss"], m["grad_norm"]) for m in overlapped.metrics]
    assert metrics == [(m["loss"], m["grad_norm"]) for m in blocking.metrics]
    assert all(torch.equal(overlapped.state[k], blocking.state[k]) for k in blocking.state)
