"""Validation loss on real gloo ranks: the mean cross-entropy over every token of the fixed validation
batches, the same (float64) under one process, tp2 x pp2 and dp2 x cp2 x ep2; evaluating changes
nothing about training; logged to metrics.jsonl."""

import json

import numpy as np
import pytest
import torch

from fived.data.loader import GlobalBatchSampler, bundled_corpus_path, load_tokens
from fived.data.prepare import prepare_data
from fived.model.transformer import build_model
from fived.parallel import lm_loss_sum
from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.training.trainer import run_training

STEPS, EVAL_EVERY, EVAL_BATCHES = 4, 2, 2
LAYOUTS = {
    "one-process": (1, {}),
    "tp2-pp2": (4, dict(parallel__tp=2, parallel__pp=2, train__microbatches=2)),
    "dp2-cp2-ep2": (4, dict(parallel__dp=2, parallel__cp=2, parallel__ep=2)),
}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """The bundled corpus prepared with a 5% validation split."""
    out = tmp_path_factory.mktemp("data") / "corpus"
    prepare_data([bundled_corpus_path()], out, val_fraction=0.05)
    return out


def _config(tokens, world_over, **extra):
    return tiny_config(
        "tiny-moe",
        train__steps=STEPS,
        train__eval_every=EVAL_EVERY,
        train__eval_batches=EVAL_BATCHES,
        data__path=str(tokens) + ".bin",
        **world_over,
        **extra,
    )


@pytest.fixture(scope="module")
def runs(tokens):
    out = {}
    for name, (world, over) in LAYOUTS.items():
        cfg = _config(tokens, over)
        out[name] = run_on_ranks(world, run_training, cfg, False, False, name == "one-process")[0]
    return out


def _val_losses(metrics):
    return {m["step"]: m["val_loss"] for m in metrics if "val_loss" in m}


def test_val_loss_is_the_same_under_every_layout(runs):
    reference = _val_losses(runs["one-process"].metrics)
    assert sorted(reference) == [2, 4]  # every eval_every steps (and the last)
    assert reference[2] != reference[4]  # the model changed in between: a real evaluation each time
    for name, result in runs.items():
        losses = _val_losses(result.metrics)
        assert sorted(losses) == sorted(reference), name
        for step, value in losses.items():
            assert abs(value - reference[step]) <= EXACT * reference[step], (name, step, value, reference[step])
        for m in result.metrics:
            if "val_loss" in m:
                assert m["val_ppl"] == pytest.approx(np.exp(m["val_loss"]), rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble", "zbv", "dualpipev"])
def test_every_pipeline_schedule_evaluates_forward_only(schedule, runs, tokens):
    """Schedules that run an action list would run its backward actions in eval; fived gives them the
    forward actions only. (1f1b is in LAYOUTS, interleaved-1f1b below with ZeRO-3.)"""
    virtual = 2 if schedule == "zero-bubble" else 1
    cfg = _config(
        tokens,
        dict(
            parallel__pp=2,
            parallel__dp=2,
            parallel__pp_schedule=schedule,
            parallel__pp_virtual=virtual,
            train__microbatches=4 if schedule == "dualpipev" else 2,
        ),
    )
    losses = _val_losses(run_on_ranks(4, run_training, cfg, False, False, False)[0].metrics)
    reference = _val_losses(runs["one-process"].metrics)
    assert sorted(losses) == sorted(reference)
    for step, value in losses.items():
        assert abs(value - reference[step]) <= EXACT * reference[step], (step, value, reference[step])


def _outputs_kept_after(cfg) -> list[int]:
    """On each pipeline rank, after a training step and an evaluation: how many micro-batch outputs its
    stages still hold (torch's schedules keep every one on the last stage unless told not to)."""
    from fived.training.trainer import Trainer

    trainer = Trainer(cfg, log=False)
    trainer.step(0)
    trainer.evaluate()
    schedule = trainer.pipeline.schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return [len(stage.output_chunks) for stage in stages]


def test_a_pipeline_evaluation_keeps_no_micro_batchs_logits(tokens):
    """The last stage holds a micro-batch's logits only while its loss is taken, in evaluation as in
    training: kept, they are every micro-batch's [tokens, vocab] at once (a 128K vocabulary: 0.5 MB a
    token in float32)."""
    cfg = _config(tokens, dict(parallel__pp=2, train__microbatches=4))
    kept = run_on_ranks(2, _outputs_kept_after, cfg)
    assert kept == [[0], [0]], kept


def test_val_loss_is_the_mean_over_every_validation_token(runs, tokens):
    """Recomputed here from the final weights: cross-entropy summed over all the tokens of the first
    EVAL_BATCHES global batches of the validation sampler, divided by their count."""
    cfg = _config(tokens, {})
    model = build_model(cfg.model, "cpu", torch.float64)
    missing, unexpected = model.load_state_dict(runs["one-process"].state, strict=False)
    assert not unexpected and all("router_bias" in k for k in missing), missing
    val = load_tokens(str(tokens) + ".val.bin")
    sampler = GlobalBatchSampler(val, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed)
    total = count = 0.0
    with torch.no_grad():
        for index in range(EVAL_BATCHES):
            batch = sampler.global_batch_at(index)
            total += lm_loss_sum(model(batch[:, :-1]), batch[:, 1:]).item()
            count += batch[:, 1:].numel()
    assert _val_losses(runs["one-process"].metrics)[STEPS] == pytest.approx(total / count, rel=1e-12)


def test_training_is_unchanged_by_evaluation(runs, tokens):
    """Evaluating draws no random numbers and moves no data position: the losses are the same to
    the last bit as a run without evaluation."""
    cfg = _config(tokens, {})
    cfg.train.eval_every = 0
    plain = run_on_ranks(1, run_training, cfg, False, False, False)[0]
    assert [m["loss"] for m in plain.metrics] == [m["loss"] for m in runs["one-process"].metrics]
    assert [m["grad_norm"] for m in plain.metrics] == [m["grad_norm"] for m in runs["one-process"].metrics]


def test_val_loss_is_logged(tokens, tmp_path):
    cfg = _config(tokens, {}, train__output_dir=str(tmp_path), train__tensorboard=False)
    run_on_ranks(1, run_training, cfg, True, False, False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert all("val_ppl" in r for r in records if "val_loss" in r)


def test_verify_compares_the_validation_loss(tokens, capsys):
    from fived.cli.main import main

    code = main(
        [
            "verify",
            "--pp",
            "2",
            "--nproc",
            "2",
            "--dp",
            "1",
            "--model",
            "tiny-moe",
            "--steps",
            "2",
            "--seq-len",
            "32",
            "--global-batch",
            "8",
            "--train.eval_every",
            "1",
            "--train.eval_batches",
            "1",
            "--data.path",
            str(tokens) + ".bin",
        ]
    )
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("max relative difference in val_loss: "))
    assert code == 0 and float(line.split(": ")[1]) <= EXACT, out


def test_too_little_validation_data_is_refused(tmp_path):
    from fived.config import ConfigError
    from fived.data.loader import check_data

    small = tmp_path / "val.txt"
    small.write_text("x" * 200)  # 6 sequences of 32 + 1 tokens, fewer than a global batch of 8
    cfg = tiny_config(train__eval_every=2, data__val_path=str(small))
    with pytest.raises(
        ConfigError,
        match=r"^data\.val_path=.*: holds 6 sequences of seq_len=32, fewer than one "
        r"global batch \(8\); hold out more data",
    ):
        check_data(cfg)
    cfg.train.eval_every = 0  # no evaluation: the validation data is not read
    check_data(cfg)
