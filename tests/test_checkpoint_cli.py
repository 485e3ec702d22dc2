"""Checkpoints as a user drives them: `fived train --resume` with another layout, what it refuses in
one line, and `fived verify --reshard-from`."""
import json
import os
import subprocess
import sys

import pytest

from fived.checkpoint import check_model_shapes, complete_checkpoints, read_manifest
from fived.cli import main
from fived.config import ConfigError
from fived.testing import tiny_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SMALL = ["--seq-len", "32", "--global-batch", "8", "--train.warmup_steps", "2"]


def fived(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fived", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """6 steps on 2 ranks (dp2, ZeRO-1), a checkpoint every 3 steps."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    done = fived("train", "--steps", "6", "--zero", "1", "--checkpoint.every", "3", "--train.output_dir", str(run),
                 *SMALL)
    assert done.returncode == 0, done.stderr
    return run


def test_resume_with_another_layout_continues_the_log(saved_run, tmp_path):
    manifest = read_manifest(saved_run / "checkpoints" / "step-6")
    assert manifest["step"] == 6 and manifest["layout"]["zero"] == 1 and manifest["world_size"] == 2
    assert manifest["config"]["checkpoint"]["async"] is False  # the resolved config, with TOML keys
    assert [s for s, _ in complete_checkpoints(saved_run)] == [3, 6]
    resumed = fived("train", "--resume", str(saved_run), "--steps", "8", "--nproc", "4", "--tp", "2", "--dp", "2",
                    "--sp")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming step 6" in resumed.stdout and "layout dp=2 tp=2" in resumed.stdout
    steps = [json.loads(line)["step"] for line in (saved_run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    assert [s for s, _ in complete_checkpoints(saved_run)][-1] == 8


@pytest.mark.parametrize("args,field", [
    (["--model.n_layers", "6"], "model.n_layers=6"),
    (["--global-batch", "16"], "train.global_batch=16"),
    (["--seed", "3"], "train.seed=3"),
    (["--steps", "6"], "train.steps=6"),  # nothing left to train (step 6 of 6)
])
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
    code = main(["verify", "--tp", "2", "--nproc", "2", "--steps", "4", *SMALL, "--reshard-from", "--dp 2 --zero 2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("steps 1-2 at 2 rank(s) dp=2 tp=1") and "resumed at 2 rank(s) dp=1 tp=2" in out[0]
    assert code == 0 and float(out[-1].split(": ")[1]) <= 1e-9


def test_reshard_from_takes_only_layout_flags(capsys):
    assert main(["verify", "--tp", "2", "--nproc", "2", "--reshard-from", "--dp 2 --steps 3"]) == 2
    assert "only layout flags may differ" in capsys.readouterr().err
