"""Checkpoints as a user drives them: `fived train --resume` with another layout, what it refuses in
one line, and `fived verify --reshard-from`."""

import json
import re

import pytest

from fived.checkpoint.checkpointer import check_model_shapes, complete_checkpoints, find_checkpoint, read_manifest
from fived.cli.main import main
from fived.config import ConfigError, tomllib
from fived.testing import run_forked, tiny_config

SMALL = ["--seq-len", "32", "--global-batch", "8", "--train.warmup_steps", "2"]


def fived(*args):
    return run_forked(main, list(args))  # (`python -m fived` but for its seconds of `import torch`)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """6 steps on 2 ranks (dp2, ZeRO-1), a checkpoint every 3 steps."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    done = fived(
        "train", "--steps", "6", "--zero", "1", "--checkpoint.every", "3", "--train.output_dir", str(run), *SMALL
    )
    assert done.returncode == 0, done.stderr
    return run


def test_resume_with_another_layout_continues_the_log(saved_run, tmp_path):
    manifest = read_manifest(saved_run / "checkpoints" / "step-6")
    assert manifest["step"] == 6 and manifest["layout"]["zero"] == 1 and manifest["world_size"] == 2
    assert manifest["config"]["checkpoint"]["async"] is False  # the resolved config, with TOML keys
    assert [s for s, _ in complete_checkpoints(saved_run)] == [3, 6]
    resumed = fived(
        "train", "--resume", str(saved_run), "--steps", "8", "--nproc", "4", "--tp", "2", "--dp", "2", "--sp"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming step 6" in resumed.stdout and "layout dp=2 tp=2" in resumed.stdout
    steps = [json.loads(line)["step"] for line in (saved_run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    assert [s for s, _ in complete_checkpoints(saved_run)][-1] == 8


@pytest.mark.parametrize(
    "args,field",
    [
        (["--model.n_layers", "6"], "model.n_layers=6"),
        (["--global-batch", "16"], "train.global_batch=16"),
        (["--seed", "3"], "train.seed=3"),
        (["--steps", "6"], "train.steps=6"),  # nothing left to train (step 6 of 6)
        (["--train.optimizer", "muon"], "train.optimizer=muon"),  # the checkpoint holds AdamW's state
    ],
)
def test_resume_refuses_in_one_line(saved_run, args, field, capsys):
    assert main(["train", "--resume", str(saved_run), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fived: error: {field}"), err


def test_resume_without_a_checkpoint_is_refused(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(saved_run):
    other = tiny_config("tiny", model__ffn_dim=96)
    with pytest.raises(ConfigError, match=r"parameter layers\.0\.feed_forward\.w1\.weight has shape \[128, 64\]"):
        check_model_shapes(other, saved_run / "checkpoints" / "step-6")


def test_verify_reshard_from_the_command_line(capsys):
    code = main(
        [
            "verify",
            "--tp",
            "2",
            "--nproc",
            "2",
            "--steps",
            "4",
            *SMALL,
            "--checkpoint.final",
            "false",
            "--reshard-from",
            "--dp 2 --zero 2",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("steps 1-2 at 2 rank(s) dp=2 tp=1") and "resumed at 2 rank(s) dp=1 tp=2" in out[0]
    assert code == 0 and float(out[-1].split(": ")[1]) <= 1e-9


def test_reshard_from_takes_only_layout_flags(capsys):
    assert main(["verify", "--tp", "2", "--nproc", "2", "--reshard-from", "--dp 2 --steps 3"]) == 2
    assert "only layout flags may differ" in capsys.readouterr().err
    # a flag without its value inside it: one line (argparse's usage block and its own error were printed first)
    assert main(["verify", "--tp", "2", "--nproc", "2", "--reshard-from=--dp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fived: error: --reshard-from=--dp: not a list of layout flags") and "\n" not in err, err


def test_reshard_from_accepts_a_flag_that_repeats_the_runs_value():
    """`--reshard-from "--dp 3 --zero 3 --global-batch 12"` beside `--global-batch 12`: nothing differs."""
    from fived.config import ConfigError, build_config
    from fived.launch.run_setup import reshard_layout

    cfg = build_config(overrides={"train.global_batch": 12, "train.steps": 4})
    first, world = reshard_layout("--dp 3 --zero 3 --global-batch 12", cfg)
    assert (first.parallel.dp, first.parallel.zero, world) == (3, 3, 3)
    with pytest.raises(ConfigError, match=r"only layout flags may differ between the halves \(train.global_batch\)"):
        reshard_layout("--dp 3 --global-batch 24", cfg)


def _prepared(argv: list[str]):
    from fived.cli.main import build_parser
    from fived.launch.run_setup import prepare_training

    ns, unknown = build_parser().parse_known_args(["train", *argv])
    assert not unknown
    return prepare_training(ns, 2)


def test_resume_keeps_the_layout_when_only_other_parallel_settings_change(saved_run):
    from fived.checkpoint.checkpointer import find_checkpoint

    saved = read_manifest(find_checkpoint(saved_run))  # (step 6, or 8 once the test above extended the run)
    run = _prepared(["--resume", str(saved_run), "--steps", "20", "--parallel.reduce_dtype", "bfloat16"])
    layout = ("dp", "tp", "pp", "zero", "sp")
    assert {k: getattr(run.cfg.parallel, k) for k in layout} == {k: saved["config"]["parallel"][k] for k in layout}
    assert run.cfg.parallel.reduce_dtype == "bfloat16" and run.world == saved["world_size"]
    moved = _prepared(["--resume", str(saved_run), "--steps", "20", "--pp", "2", "--nproc", "2", "--dp", "1"])
    assert (moved.cfg.parallel.pp, moved.cfg.train.microbatches) == (2, 2)  # at least pp micro-batches


def test_resume_may_add_validation(saved_run):
    """Validation data is never trained on: a resumed run may add it (data.val_path, train.eval_every)."""
    from fived.data.loader import bundled_corpus_path

    run = _prepared(
        [
            "--resume",
            str(saved_run),
            "--steps",
            "20",
            "--train.eval_every",
            "5",
            "--data.val_path",
            str(bundled_corpus_path()),
        ]
    )
    assert (run.cfg.train.eval_every, run.cfg.data.val_path) == (5, str(bundled_corpus_path()))


def test_resume_auto_of_a_finished_run_does_nothing(saved_run, capsys):
    assert main(["train", "--resume", "auto", "--train.output_dir", str(saved_run), "--steps", "6", *SMALL]) == 0
    assert "already reached train.steps=6" in capsys.readouterr().out  # (it is at step 6 or 8)
    # without --steps: the run's own train.steps (its saved config's), not this command's default (200)
    assert main(["train", "--resume", "auto", "--train.output_dir", str(saved_run), *SMALL]) == 0
    said = re.search(r"already reached train.steps=(\d+) \(its checkpoint: step (\d+)\)", capsys.readouterr().out)
    assert said and int(said[1]) == tomllib.loads((saved_run / "config.toml").read_text())["train"]["steps"]
    assert int(said[1]) <= int(said[2]) == read_manifest(find_checkpoint(saved_run))["step"]


def test_resume_refuses_data_that_changed(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    run = tmp_path / "run"
    common = ["--data.path", str(text), "--seq-len", "32", "--global-batch", "4", "--nproc", "1", "--dp", "1"]
    assert main(["train", "--steps", "2", "--train.output_dir", str(run), *common]) == 0
    with open(text, "a") as f:
        f.write("and then some more text arrived. " * 100)
    assert main(["train", "--resume", str(run), "--steps", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fived: error: data.path=") and "the data changed" in err, err
