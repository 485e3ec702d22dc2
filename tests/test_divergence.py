"""The divergence guard: a run whose loss or gradients go bad stops at that step (or rolls back to a
healthy checkpoint) and loses nothing saved before it; impossible optimizer settings are refused
before launch."""

import json
import math
import re

import pytest
import torch

from fived.checkpoint.checkpointer import complete_checkpoints
from fived.cli.main import main
from fived.config import ConfigError, build_config
from fived.launch.ranks import RankFailed
from fived.layout.rules import check_config
from fived.testing import run_forked, run_on_ranks, tiny_config
from fived.training.divergence import DIVERGED_EXIT, LossGuard, healthy_checkpoint
from fived.training.trainer import Trainer, run_training

STEPS, EVERY, POISONED = 12, 2, 6  # the gradients of step index 6 (logged as step 7) are NaN


def test_the_guard_flags_non_finite_values_and_spikes_over_the_window_median():
    guard = LossGuard(factor=3.0, window=3, vocab_size=256)
    assert "loss is nan" in guard.verdict(math.nan, 1.0)
    assert "gradient norm is inf" in guard.verdict(2.0, math.inf)
    assert "uniform guess" in guard.verdict(16.7, 1.0)  # the first step: 3 x ln(256) = 16.6
    assert guard.verdict(16.5, 1.0) is None
    for loss in (2.0, 1.0, 1.5):
        assert "x" in guard.verdict(8e5, 1.0)  # (the window not yet full: ln(256), then the median so far)
        guard.accept(loss)
    assert guard.verdict(4.4, 1.0) is None
    assert "median of the last 3 steps" in guard.verdict(4.6, 1.0)  # 3 x median 1.5 = 4.5
    restored = LossGuard(factor=3.0, window=2)
    restored.load_state(guard.state())
    assert list(restored.recent) == [1.0, 1.5]  # (a smaller window keeps the newest)


@pytest.mark.parametrize(
    "over, rule",
    [
        ({"train.lr": "inf"}, "train.lr=inf: must be > 0 and finite"),
        ({"train.lr": -1e-3}, "train.lr=-0.001: must be > 0"),
        ({"train.lr": "nan"}, "train.lr=nan"),
        ({"train.beta2": 1.0}, "train.beta2=1.0: must be in [0, 1)"),
        ({"train.eps": 0}, "train.eps=0.0: must be > 0"),
        ({"train.spike_factor": 0.5}, "train.spike_factor=0.5"),
        ({"train.on_spike": "pray"}, "train.on_spike=pray: must be one of stop, rollback"),
    ],
)
def test_impossible_optimizer_settings_are_refused_before_launch(over, rule):
    with pytest.raises(ConfigError, match="^" + re.escape(rule)):
        check_config(build_config(overrides=over), 2)


def _poison(patch, at_step: int, *, times: int = 1, then_kill_at: int | None = None) -> None:
    """NaN gradients on the first `times` passes through step index `at_step` (before clipping and the
    optimizer step: the weights really go bad); with `then_kill_at`, a later pass through that step
    index raises, as a crash would. Forked ranks inherit the patch."""
    real_step, real_read = Trainer._step, Trainer._read_moe_statistics
    fired = []

    def step(self, step):
        if fired and step == then_kill_at:
            raise RuntimeError(f"killed before the save of step {step + 1}")  # (logged step numbers)
        self.poison = step == at_step and len(fired) < times
        fired.extend([step] if self.poison else [])
        return real_step(self, step)

    def read(self):
        if self.poison:
            for p in self.model.parameters():
                p.grad.fill_(math.nan)
        return real_read(self)

    patch.setattr(Trainer, "_step", step)
    patch.setattr(Trainer, "_read_moe_statistics", read)


def _config(run_dir, **over):
    over = {"train__steps": STEPS, "checkpoint__every": EVERY, "checkpoint__keep": 2, **over}
    return tiny_config("tiny", train__output_dir=str(run_dir), **over)


def _logged(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_diverged_step_stops_the_run_and_keeps_every_healthy_checkpoint(tmp_path, monkeypatch):
    _poison(monkeypatch, POISONED)
    with pytest.raises(RankFailed) as failed:
        run_on_ranks(1, run_training, _config(tmp_path), True, False, False)
    (summary,) = failed.value.summaries
    assert summary["kind"] == "diverged" and summary["step"] == POISONED + 1
    assert "gradient norm is nan" in summary["line"] and "step-4" in summary["line"]
    # step-6's weights gave step 7 its loss: set aside (kept), not loadable; 2 and 4 untouched
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 4]
    assert [p.name for p in (tmp_path / "checkpoints").glob("diverged-*/step-*")] == ["step-6"]
    assert [r["step"] for r in _logged(tmp_path)] == list(range(1, POISONED + 1))  # never the diverged step


def _trained_with_skip(cfg, at: int, count: int):
    trainer = Trainer(cfg, log=False)
    trainer.sampler.skip(at, count)
    return trainer.fit(progress=False)


def test_rollback_ends_as_the_run_that_skipped_the_window(tmp_path, monkeypatch):
    """One injected divergence at step 7: rolled back to step-4 (the newest checkpoint whose next
    step passed), the data of steps 5..7 skipped; the run ends exactly (float64) as a run that never
    diverged and skipped the same window."""
    cfg = _config(tmp_path, train__on_spike="rollback", train__max_rollbacks=1)
    with monkeypatch.context() as patch:
        _poison(patch, POISONED)
        rolled = run_on_ranks(1, run_training, cfg, True, False, False)[0]
    reference = run_on_ranks(1, _trained_with_skip, _config(tmp_path / "ref"), 4, POISONED + 1 - 4)[0]
    assert [r["loss"] for r in rolled.metrics] == [r["loss"] for r in reference]
    assert rolled.metrics[-1]["step"] == STEPS
    assert [r["loss"] for r in _logged(tmp_path)] == [r["loss"] for r in reference]  # each step logged once
    (event,) = [json.loads(line) for line in (tmp_path / "rollbacks.jsonl").read_text().splitlines()]
    assert event["from_step"] == 4 and event["skipped_steps"] == [5, 7] and event["rollback"] == 1
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [8, 10, 12]


def test_with_keep_1_the_guard_rolls_back_to_a_healthy_step_and_the_resumed_one_is_kept(tmp_path, monkeypatch):
    """checkpoint.keep 1: pruning keeps the newest checkpoint the guard confirmed beside the newest, so
    a divergence at step 7 rolls back to step-4; and the checkpoint a launch resumed from is never
    pruned by it (a bad resumed setting can break the weights into a loss the guard passes)."""
    run_on_ranks(1, run_training, _config(tmp_path, train__steps=4, checkpoint__keep=1), True, False, False)
    cfg = _config(tmp_path, train__steps=10, checkpoint__keep=1, train__on_spike="rollback", train__max_rollbacks=1)
    _poison(monkeypatch, POISONED)
    run_on_ranks(1, run_training, cfg, True, False, False, str(tmp_path / "checkpoints" / "step-4"))
    (event,) = [json.loads(line) for line in (tmp_path / "rollbacks.jsonl").read_text().splitlines()]
    assert event["from_step"] == 4 and event["diverged_step"] == POISONED + 1
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 8, 10]  # (keep 1 alone: [8, 10])


def test_a_second_divergence_beyond_max_rollbacks_stops(tmp_path, monkeypatch):
    cfg = _config(tmp_path, train__on_spike="rollback", train__max_rollbacks=0)
    _poison(monkeypatch, POISONED)
    with pytest.raises(RankFailed) as failed:
        run_on_ranks(1, run_training, cfg, True, False, False)
    assert "after 0 rollbacks" in failed.value.summaries[0]["line"]


def test_the_healthy_checkpoint_is_one_whose_next_step_passed(tmp_path, monkeypatch):
    import fived.training.divergence

    monkeypatch.setattr(fived.training.divergence, "cached_damage", lambda path: None)  # (empty stand-ins: intact)
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step-{step}").mkdir(parents=True)
        for name in ("COMPLETE", "fived.json"):
            (root / f"step-{step}" / name).write_text("")
    assert healthy_checkpoint(tmp_path, 7) == (4, root / "step-4")  # step-6's next step diverged
    assert healthy_checkpoint(tmp_path, 3) is None


def test_a_diverging_resumed_run_exits_in_one_line_and_loses_no_checkpoint(tmp_path):
    """The issue's case: a run with good checkpoints resumed at --train.lr 1e3 (keep small): it stops
    at the first spiking step with exit code 65, and every checkpoint it had is still there."""
    run = tmp_path / "run"
    small = ["--nproc", "1", "--seq-len", "32", "--global-batch", "8", "--train.spike_window", "4"]
    first = run_forked(
        main,
        ["train", "--steps", "6", "--checkpoint.every", "2", "--checkpoint.keep", "1", "--train.output_dir", str(run)]
        + small,
    )
    assert first.returncode == 0, first.stderr
    before = [s for s, _ in complete_checkpoints(run)]
    assert before == [4, 6]
    diverging = run_forked(main, ["train", "--resume", str(run), "--train.lr", "1e3", "--steps", "40"])
    assert diverging.returncode == DIVERGED_EXIT, diverging.stderr
    lines = [line for line in diverging.stderr.splitlines() if "fived train:" in line]
    assert len(lines) == 1 and "diverged at step" in lines[0] and "Traceback" not in diverging.stderr, diverging.stderr
    assert [s for s, _ in complete_checkpoints(run)] == before
    assert torch.isfinite(torch.tensor([r["loss"] for r in _logged(run)])).all()
    # The hint is a command that works: the launch's --steps (it extended the run) and the lr to go under
    hint = re.search(
        r"continue with: (fived train --resume \S+ --steps 40) and a lower --train.lr than 1000 ", lines[0]
    )
    assert hint, lines[0]
    assert "lr = 1000.0" not in (run / "config.toml").read_text()  # (the diverging launch's config: not kept)
    assert json.loads((run / "launches.jsonl").read_text().splitlines()[-1])["config"]["train"]["lr"] == 1e3
    followed = run_forked(main, [*hint.group(1).split()[1:], "--train.lr", "1e-3"])  # (after "fived")
    assert followed.returncode == 0, followed.stderr


def test_each_rollback_skips_further(tmp_path, monkeypatch):
    """The same step diverging twice (the injection fires on each of the first two passes): the
    second rollback skips the window after the first one's, never the same data again."""
    cfg = _config(tmp_path, train__on_spike="rollback", train__max_rollbacks=2)
    with monkeypatch.context() as patch:
        _poison(patch, POISONED, times=2)
        rolled = run_on_ranks(1, run_training, cfg, True, False, False)[0]
    assert rolled.metrics[-1]["step"] == STEPS
    events = [json.loads(line) for line in (tmp_path / "rollbacks.jsonl").read_text().splitlines()]
    assert [e["from_step"] for e in events] == [4, 4]
    reference = run_on_ranks(1, _trained_with_skip, _config(tmp_path / "ref"), 4, 2 * (POISONED + 1 - 4))[0]
    assert [r["loss"] for r in rolled.metrics] == [r["loss"] for r in reference]


def test_every_rank_rolls_back_to_the_checkpoint_rank_0_chose(tmp_path, monkeypatch):
    """A transient read error on rank 1 alone (its view of step-4 looks damaged) must not send rank 1
    to an older checkpoint than rank 0: rank 0 chooses the healthy checkpoint and every rank loads it,
    so the 2-rank run ends exactly as the run that skipped the window from step 4."""
    import torch.distributed as dist

    import fived.training.divergence

    real = fived.training.divergence.cached_damage

    def flaky(path):
        if dist.get_rank() == 1 and path.name == "step-4":
            return f"{path}: [Errno 5] Input/output error"
        return real(path)

    cfg = _config(tmp_path, train__on_spike="rollback", train__max_rollbacks=1)
    with monkeypatch.context() as patch:
        _poison(patch, POISONED)
        patch.setattr(fived.training.divergence, "cached_damage", flaky)
        rolled = run_on_ranks(2, run_training, cfg, True, False, False)
    reference = run_on_ranks(2, _trained_with_skip, _config(tmp_path / "ref"), 4, POISONED + 1 - 4)[0]
    assert [r["loss"] for r in rolled[0].metrics] == [r["loss"] for r in reference]
    assert [r["loss"] for r in rolled[1].metrics] == [r["loss"] for r in reference]


def test_a_crash_after_a_rollback_resumes_with_the_window_still_skipped(tmp_path, monkeypatch):
    """Rolled back at step 7 to step-4 (steps 5..7 skipped), then killed at step 6, before the next
    periodic save: resuming the run's newest checkpoint skips the same window, so the resumed run's
    losses are those of the run that skipped it."""
    cfg = _config(tmp_path, train__on_spike="rollback", train__max_rollbacks=1)
    with monkeypatch.context() as patch:
        _poison(patch, POISONED, then_kill_at=POISONED - 1)
        with pytest.raises(RankFailed, match="killed before the save"):
            run_on_ranks(1, run_training, cfg, True, False, False)
    (newest_step, newest), *_ = reversed(complete_checkpoints(tmp_path))
    assert newest_step == 4
    resumed = run_on_ranks(1, run_training, cfg, True, False, False, str(newest))[0]
    reference = run_on_ranks(1, _trained_with_skip, _config(tmp_path / "ref"), 4, POISONED + 1 - 4)[0]
    assert [r["loss"] for r in resumed.metrics] == [r["loss"] for r in reference[4:]]
    assert not list((tmp_path / "checkpoints").glob("superseded-*"))  # (the replaced step-4 is not kept twice)
