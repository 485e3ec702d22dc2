"""The learning-rate plan (fived.optim.lr_schedule): each schedule's shape, and the plan surviving a resume
that extends the run: every step of the resumed, extended run has the lr the original run planned
for it, and the steps beyond that plan stay at the end of the decay."""

import itertools
import json
import math

import pytest

from fived.cli.main import main
from fived.config import TrainConfig
from fived.optim.lr_schedule import decay_steps_of, describe_schedule, lr_multiplier, wsd_decay_start


def plan(**fields) -> list[float]:
    t = TrainConfig(**fields)
    return [lr_multiplier(step, t) for step in range(t.steps + 20)]


def test_warmup_then_each_schedule_to_its_floor():
    for schedule in ("cosine", "linear", "wsd", "constant"):
        lrs = plan(steps=100, warmup_steps=10, lr_schedule=schedule, min_lr_ratio=0.1)
        assert lrs[:10] == [(s + 1) / 10 for s in range(10)], schedule
        after = lrs[10:]
        assert all(a >= b for a, b in itertools.pairwise(after)), schedule  # never rises after warmup
        assert lrs[100:] == [1.0 if schedule == "constant" else 0.1] * 20, schedule
    cosine = plan(steps=100, warmup_steps=10)
    assert cosine[10] == 1.0 and cosine[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    linear = plan(steps=100, warmup_steps=10, lr_schedule="linear")
    assert linear[55] == pytest.approx(0.55)


def test_a_decay_that_ends_within_the_warmup_leaves_the_floor_after_it():
    """A 6-step run with the default 20-step warmup, extended to 30: steps 7-20 still warm up (its
    plan), then the floor; not one step at the full lr first, and the header line says so (it said
    "steps after 6 at 0.0003" of steps still warming up)."""
    for schedule in ("cosine", "linear", "wsd"):
        t = TrainConfig(steps=30, decay_steps=6, warmup_steps=20, lr_schedule=schedule, lr=3e-3, min_lr_ratio=0.1)
        lrs = [lr_multiplier(s, t) for s in range(30)]
        assert lrs[:20] == [(s + 1) / 20 for s in range(20)] and lrs[20:] == [0.1] * 10, schedule
        assert describe_schedule(t).endswith(
            f"warmup 20, past the {schedule} decay's end at step 6: 0.0003 from step 21)"
        )
    # (a run that ends within its warmup, not extended, never reaches the floor: not announced)
    assert "from step 21" not in describe_schedule(TrainConfig(steps=20, warmup_steps=20))


def test_wsd_is_stable_until_its_decay_fraction():
    t = TrainConfig(steps=100, warmup_steps=10, lr_schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    assert wsd_decay_start(t) == 80
    lrs = [lr_multiplier(s, t) for s in range(110)]
    assert lrs[10:81] == [1.0] * 71 and lrs[90] == pytest.approx(0.5) and lrs[100:] == [0.0] * 10
    assert "stable to step 80, decay over steps 81-100" in describe_schedule(t)


def test_decay_steps_not_steps_fix_the_plan():
    """Once decay_steps is set (a run's first launch sets it to train.steps), train.steps no longer
    moves any step's lr: the issue's 400-step run resumed with --steps 600 kept step 151's lr."""
    for schedule in ("cosine", "linear", "wsd"):
        planned = TrainConfig(steps=400, decay_steps=400, lr_schedule=schedule, lr=3e-3)
        extended = TrainConfig(steps=600, decay_steps=400, lr_schedule=schedule, lr=3e-3)
        assert [lr_multiplier(s, planned) for s in range(400)] == [lr_multiplier(s, extended) for s in range(400)]
    assert decay_steps_of(TrainConfig(steps=600)) == 600  # (0: the run's own steps)
    cosine = TrainConfig(steps=600, decay_steps=400, lr=3e-3)
    assert 3e-3 * lr_multiplier(150, cosine) == pytest.approx(2.30e-3, abs=0.01e-3)  # the step 151
    assert "steps after 400 at 0.0003" in describe_schedule(cosine)


def _lrs(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


TINY = [
    "--nproc",
    "2",
    "--seq-len",
    "16",
    "--global-batch",
    "4",
    "--train.warmup_steps",
    "2",
    "--train.log_every",
    "100",
]


def test_a_resumed_extended_run_keeps_the_original_plans_lr(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "8", "--checkpoint.every", "4", "--train.output_dir", str(run)]) == 0
    original = _lrs(run)
    assert sorted(original) == list(range(1, 9)) and original[8] > 3e-4  # (still decaying at its last step)
    # continue from step 4 with twice the steps: steps 5-8 as planned, 9-16 at the end of the decay
    assert main(["train", "--resume", str(run / "checkpoints" / "step-4"), "--nproc", "2", "--steps", "16"]) == 0
    resumed = _lrs(run)
    assert sorted(resumed) == list(range(1, 17))
    assert [resumed[s] for s in range(1, 9)] == [original[s] for s in range(1, 9)]  # exactly, not approximately
    assert [resumed[s] for s in range(9, 17)] == [pytest.approx(3e-3 * 0.1, rel=1e-12)] * 8
    out = capsys.readouterr().out
    assert "cosine decay to step 8" in out and "steps after 8 at 0.0003" in out


def test_a_wsd_run_extended_before_its_decay_replans_it_on_purpose(tmp_path, capsys):
    run = tmp_path / "run"
    args = [*TINY, "--train.lr_schedule", "wsd", "--train.decay_fraction", "0.25", "--checkpoint.every", "4"]
    assert main(["train", *args, "--steps", "8", "--train.output_dir", str(run)]) == 0
    original = _lrs(run)
    assert [original[s] for s in (3, 4, 5, 6, 7)] == [3e-3] * 5 and original[8] < 3e-3  # its decay: steps 7-8
    # --train.decay_steps moves the decay to the new end (steps 13-16): steps 7 and 8 now stay at lr
    assert (
        main(
            [
                "train",
                "--resume",
                str(run / "checkpoints" / "step-4"),
                "--nproc",
                "2",
                "--steps",
                "16",
                "--train.decay_steps",
                "16",
            ]
        )
        == 0
    )
    resumed = _lrs(run)
    assert [resumed[s] for s in range(3, 14)] == [3e-3] * 11 and resumed[16] < resumed[14] < 3e-3
    saved = json.loads((run / "launches.jsonl").read_text().splitlines()[-1])["config"]["train"]
    assert saved["decay_steps"] == 16 and saved["lr_schedule"] == "wsd"
