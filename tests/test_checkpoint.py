"""Checkpoints on real gloo ranks: a run stopped and resumed equals the uninterrupted run to the last
bit (every dimension, every ZeRO stage, dense and MoE); a checkpoint written by one layout continues
at any other exactly like one device; background saves load exactly."""

import copy
import json

import pytest
import torch

from fived.checkpoint.checkpointer import complete_checkpoints, find_checkpoint
from fived.testing import EXACT, run_on_ranks, tiny_config, write_documents
from fived.tools.verification import run_verify
from fived.training.trainer import run_training

STEPS = 4


def _whole_then_checkpointed(cfg, output_dir: str, until: int | None = STEPS // 2):
    """On one rank: the run straight through (writing nothing), then the same run from its start,
    writing checkpoints into output_dir, stopped after `until` steps. Both in one launch: starting
    the ranks costs more than the steps, and each run_training builds its own model, groups and data
    from the config."""
    whole = run_training(cfg, False, False, True)
    cfg = copy.deepcopy(cfg)
    cfg.train.output_dir = output_dir
    return whole, run_training(cfg, True, False, False, None, until)


def _uninterrupted_and_resumed(world: int, cfg, tmp_path):
    """The run straight through, and the same run stopped after half the steps and resumed (the
    resumed half in fresh processes, as a real resume is)."""
    whole, first = zip(*run_on_ranks(world, _whole_then_checkpointed, cfg, str(tmp_path)))
    cfg.train.output_dir = str(tmp_path)
    second = run_on_ranks(world, run_training, cfg, True, False, True, str(find_checkpoint(tmp_path)))
    return whole, first, second


LAYOUTS = {
    "zero0-dp4": ("tiny", 4, dict(parallel__dp=4)),
    "zero1-dp2-tp2": ("tiny-moe", 4, dict(parallel__dp=2, parallel__tp=2, parallel__zero=1)),
    "zero2-dp4-micro2": ("tiny", 4, dict(parallel__dp=4, parallel__zero=2, train__microbatches=2)),
    "zero3-hsdp": (
        "tiny-moe",
        4,
        dict(parallel__dp=4, parallel__dp_replicate=2, parallel__zero=3, model__router_bias_rate=0.01),
    ),
    "tp2-sp": ("tiny", 2, dict(parallel__tp=2, parallel__sp=True)),
    "pp2-interleaved": (
        "tiny-moe",
        4,
        dict(
            parallel__pp=2,
            parallel__dp=2,
            parallel__pp_schedule="interleaved-1f1b",
            parallel__pp_virtual=2,
            train__microbatches=2,
        ),
    ),
    "cp2-ep2": ("tiny-moe", 4, dict(parallel__cp=2, parallel__dp=2, parallel__ep=2, model__router_bias_rate=0.01)),
    "ep2-zero3": ("tiny-moe", 2, dict(parallel__dp=2, parallel__ep=2, parallel__zero=3)),
    # multi-token prediction on the last stage: its copy of the embedding is no checkpoint entry
    "pp2-mtp": ("tiny-deepseek-v3", 2, dict(parallel__pp=2, train__microbatches=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bit_exact(layout, tmp_path):
    model, world, over = LAYOUTS[layout]
    cfg = tiny_config(model, train__steps=STEPS, **over)
    whole, first, second = _uninterrupted_and_resumed(world, cfg, tmp_path)
    assert [m["loss"] for m in whole[0].metrics] == [m["loss"] for m in first[0].metrics + second[0].metrics]
    assert [m["grad_norm"] for m in whole[0].metrics] == [m["grad_norm"] for m in first[0].metrics + second[0].metrics]
    for name, value in whole[0].state.items():
        assert torch.equal(value, second[0].state[name]), name
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1))  # each step once, in order


@pytest.mark.parametrize("zero", [0, 2])
def test_resume_is_bit_exact_with_many_buckets(tmp_path, zero):
    """ZeRO-0's buckets, and ZeRO-2's overlapped ones, launch in order during backward; with 3 kB
    buckets (dozens of them) a resumed run still equals the uninterrupted one to the last bit."""
    overlap = zero > 0
    cfg = tiny_config(
        "tiny-moe",
        train__steps=STEPS,
        parallel__dp=4,
        train__microbatches=2,
        parallel__zero=zero,
        parallel__bucket_mb=3000 / 2**20,
        parallel__overlap_grad_reduce=overlap,
        parallel__overlap_param_gather=overlap,
    )
    whole, first, second = _uninterrupted_and_resumed(4, cfg, tmp_path)
    assert [m["loss"] for m in whole[0].metrics] == [m["loss"] for m in first[0].metrics + second[0].metrics]
    for name, value in whole[0].state.items():
        assert torch.equal(value, second[0].state[name]), name


EVALUATED = {
    "pp2-dp2-moe": ("tiny-moe", dict(parallel__pp=2, parallel__dp=2, model__router_bias_rate=0.01)),
    "zero3-dp4": ("tiny", dict(parallel__dp=4, parallel__zero=3)),  # (evaluation leaves FSDP's root gathered)
}


@pytest.mark.parametrize("layout", list(EVALUATED))
def test_resume_is_bit_exact_with_evaluation(layout, tmp_path):
    """Evaluating every step (a pipeline's eval path, MoE router biases moving, ZeRO-3's gathered
    weights) neither draws random numbers nor moves the data position, and leaves every parameter
    as a checkpoint expects it: the resumed run equals the uninterrupted one to the last bit,
    validation losses included."""
    from fived.data.loader import bundled_corpus_path

    model, over = EVALUATED[layout]
    cfg = tiny_config(
        model,
        train__steps=STEPS,
        train__microbatches=2,
        train__eval_every=1,
        train__eval_batches=1,
        data__val_path=str(bundled_corpus_path()),
        **over,
    )
    whole, first, second = _uninterrupted_and_resumed(4, cfg, tmp_path)
    for key in ("loss", "grad_norm", "val_loss"):
        assert [m[key] for m in whole[0].metrics] == [m[key] for m in first[0].metrics + second[0].metrics], key
    for name, value in whole[0].state.items():
        assert torch.equal(value, second[0].state[name]), name


BF16 = {
    "zero0-dp2": ("tiny", 2, dict(parallel__dp=2)),
    "zero2-dp2-micro2": (
        "tiny-moe",
        2,
        dict(parallel__dp=2, parallel__zero=2, train__microbatches=2, model__router_bias_rate=0.01),
    ),
    "zero3-dp2": ("tiny", 2, dict(parallel__dp=2, parallel__zero=3)),
    "pp2-zero0": ("tiny", 2, dict(parallel__pp=2, train__microbatches=2)),
}


@pytest.mark.parametrize("layout", list(BF16))
def test_bf16_resume_is_bit_exact(layout, tmp_path):
    """train.dtype=bfloat16: checkpoints hold the float32 masters as the parameters' values, so a
    resumed bf16 run equals the uninterrupted one to the last bit (masters, moments, losses)."""
    model, world, over = BF16[layout]
    cfg = tiny_config(model, train__steps=STEPS, train__dtype="bfloat16", **over)
    whole, first, second = _uninterrupted_and_resumed(world, cfg, tmp_path)
    assert [m["loss"] for m in whole[0].metrics] == [m["loss"] for m in first[0].metrics + second[0].metrics]
    for name, value in whole[0].state.items():
        assert value.dtype == torch.float32 and torch.equal(value, second[0].state[name]), name


def test_bf16_masters_reshard_exactly(tmp_path):
    """A bf16 checkpoint written by ZeRO-1 over 4 ranks loads at ZeRO-3 over 2 and at tp=2 (a ZeRO-0
    rank): the float32 masters arrive to the last bit (not rounded through the bf16 weights)."""
    cfg = tiny_config("tiny", train__steps=STEPS, train__dtype="bfloat16", parallel__dp=4, parallel__zero=1)
    cfg.train.output_dir = str(tmp_path)
    saved = run_on_ranks(4, run_training, cfg, True, False, True, None, STEPS // 2)[0].state
    assert any(not torch.equal(v, v.bfloat16().float()) for v in saved.values())  # masters hold more than bf16
    checkpoint = str(find_checkpoint(tmp_path))
    layouts = (dict(parallel__dp=2, parallel__zero=3), dict(parallel__tp=2))  # (both on 2 ranks: one launch)
    others = [tiny_config("tiny", train__steps=STEPS, train__dtype="bfloat16", **over) for over in layouts]
    each_loaded = run_on_ranks(2, _each_loaded, others, checkpoint)[0]
    for over, loaded in zip(layouts, each_loaded, strict=True):
        for name, value in saved.items():
            assert torch.equal(value, loaded[name]), (over, name)


def _each_loaded(configs, checkpoint: str) -> list[dict]:
    """On one rank: each configuration's state just after loading `checkpoint` (no step taken)."""
    return [run_training(cfg, False, False, True, checkpoint, STEPS // 2).state for cfg in configs]


# (first half's layout, second half's layout, model): together they change every dimension and every
# ZeRO stage in both directions, and include an odd dp, a padded vocabulary, tied embeddings and MoE
# router biases that move (so buffers are saved and loaded with real values).
MOE = {"model__name": "tiny-moe", "model__router_bias_rate": 0.01}
RESHARD = [
    (dict(parallel__dp=4, parallel__zero=1), dict(parallel__tp=2, parallel__pp=2, train__microbatches=2), {}),
    (dict(parallel__tp=2, parallel__pp=2, train__microbatches=2), dict(parallel__dp=4, parallel__zero=1), {}),
    (
        dict(parallel__pp=2, parallel__dp=2, parallel__zero=3, parallel__ep=2, train__microbatches=2),
        dict(parallel__dp=4, parallel__ep=4, parallel__zero=2),
        MOE,
    ),
    (
        dict(parallel__dp=4, parallel__ep=4, parallel__zero=2),
        dict(parallel__pp=2, parallel__dp=2, parallel__zero=3, parallel__ep=2, train__microbatches=2),
        MOE,
    ),
    (dict(parallel__cp=2, parallel__tp=2, parallel__sp=True), dict(parallel__dp=4, parallel__zero=3), {}),
    (dict(parallel__dp=4, parallel__zero=3), dict(parallel__cp=2, parallel__tp=2, parallel__sp=True), {}),
    (dict(parallel__dp=3, parallel__zero=2), dict(parallel__dp=2, parallel__zero=0), {}),
    (dict(parallel__dp=2, parallel__zero=0), dict(parallel__dp=3, parallel__zero=1), MOE),
    (
        dict(parallel__dp=4, parallel__dp_replicate=2, parallel__zero=3),
        dict(parallel__pp=2, parallel__dp=2, parallel__pp_schedule="zbv", train__microbatches=2),
        {},
    ),
    (
        dict(
            parallel__pp=2,
            parallel__tp=2,
            parallel__pp_schedule="interleaved-1f1b",
            parallel__pp_virtual=2,
            train__microbatches=2,
        ),
        dict(parallel__dp=4, parallel__dp_replicate=2, parallel__zero=1),
        {},
    ),
    (dict(parallel__tp=4), dict(parallel__cp=2, parallel__ep=2, parallel__dp=1), MOE),
    (
        dict(parallel__tp=4, parallel__zero=0),
        dict(parallel__dp=2, parallel__tp=2, parallel__zero=3),
        {"model__vocab_size": 259},
    ),  # vocabulary padded to 260 under tp4, 260 under tp2: padding never saved
    (
        dict(parallel__dp=4, parallel__dp_replicate=2, parallel__zero=1),
        dict(parallel__tp=4),
        {"model__tie_embeddings": True},
    ),
    (
        dict(parallel__pp=2, train__microbatches=2),
        dict(parallel__tp=2, parallel__sp=True),
        {"model__name": "tiny-deepseek-v3"},
    ),
]


def _world(over: dict) -> int:
    return (
        over.get("parallel__dp", 1)
        * over.get("parallel__tp", 1)
        * over.get("parallel__pp", 1)
        * over.get("parallel__cp", 1)
    )


def _pair_id(value) -> str:
    return "-".join(f"{k.split('__')[1]}{v}" for k, v in value.items()) or "tiny"


@pytest.mark.parametrize("first,second,model", RESHARD, ids=_pair_id)
def test_reshard_is_exact(first, second, model):
    global_batch = 12 if 3 in (first.get("parallel__dp"), second.get("parallel__dp")) else 8
    model = {"model__name": "tiny", **model}
    a = tiny_config(train__steps=STEPS, train__global_batch=global_batch, **model, **first)
    b = tiny_config(train__steps=STEPS, train__global_batch=global_batch, **model, **second)
    report = run_verify(b, _world(second), printer=lambda *_: None, reshard_from=(a, _world(first)))
    assert len(report.rows) == STEPS
    assert report.max_relative_difference <= EXACT, report.max_rel


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("docs") / "docs.txt")


DOCUMENT_MASKED = {  # data.document_mask: the work-balanced cp assignment is a function of the tokens
    "cp2-ulysses-eval": (
        "tiny",
        2,
        dict(parallel__cp=2, parallel__dp=1, parallel__cp_mode="ulysses", train__eval_every=1, train__eval_batches=1),
    ),
    "dp2-cp2-ep2-moe": (
        "tiny-moe",
        4,
        dict(parallel__cp=2, parallel__dp=2, parallel__ep=2, parallel__zero=1, model__router_bias_rate=0.01),
    ),
}


@pytest.mark.parametrize("layout", list(DOCUMENT_MASKED))
def test_document_masked_resume_is_bit_exact(layout, documents, tmp_path):
    model, world, over = DOCUMENT_MASKED[layout]
    cfg = tiny_config(
        model, train__steps=STEPS, data__path=documents, data__val_path=documents, data__document_mask=True, **over
    )
    whole, first, second = _uninterrupted_and_resumed(world, cfg, tmp_path)
    keys = ("loss", "grad_norm") + (("val_loss",) if over.get("train__eval_every") else ())
    for key in keys:
        assert [m[key] for m in whole[0].metrics] == [m[key] for m in first[0].metrics + second[0].metrics], key
    for name, value in whole[0].state.items():
        assert torch.equal(value, second[0].state[name]), name


@pytest.mark.parametrize(
    "first,second",
    [
        (dict(parallel__cp=4, parallel__cp_mode="hybrid"), dict(parallel__dp=2, parallel__tp=2, parallel__sp=True)),
        (
            dict(parallel__dp=2, parallel__pp=2, train__microbatches=2),
            dict(parallel__cp=2, parallel__dp=2, parallel__zero=3, parallel__cp_mode="ulysses"),
        ),
    ],
    ids=["hybrid-to-dp-tp", "pp-to-ulysses-zero3"],
)
def test_document_masked_reshard_is_exact(first, second, documents):
    masked = dict(model__name="tiny", train__steps=STEPS, data__path=documents, data__document_mask=True)
    a, b = tiny_config(**masked, **first), tiny_config(**masked, **second)
    report = run_verify(b, _world(second), printer=lambda *_: None, reshard_from=(a, _world(first)))
    assert len(report.rows) == STEPS
    assert report.max_relative_difference <= EXACT, report.max_rel


def test_background_save_loads_exactly(tmp_path):
    """checkpoint.async: saves written from a background thread (from staging copies allocated once,
    after the first step) resume the run exactly, and the time training waited is logged."""
    cfg = tiny_config(
        "tiny-moe", train__steps=6, parallel__dp=2, parallel__zero=2, checkpoint__every=2, checkpoint__async=True
    )
    whole, saved = run_on_ranks(2, _whole_then_checkpointed, cfg, str(tmp_path), None)[0]
    cfg.train.output_dir = str(tmp_path)
    assert "checkpoint_s" in saved.metrics[2] and "checkpoint_s" in saved.metrics[4]  # (with the step after)
    assert "checkpoint_prepare_s" in saved.metrics[0]  # staging copies allocated after the first step
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 4, 6]  # (keep 3)
    resumed = run_on_ranks(2, run_training, cfg, True, False, True, str(tmp_path / "checkpoints" / "step-4"))[0]
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in whole.metrics[4:]]
    for name, value in whole.state.items():
        assert torch.equal(value, resumed.state[name]), name
