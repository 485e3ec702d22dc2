"""The command line as a user runs it: real processes, real files."""

import json
import os
import subprocess
import sys

import pytest

from fived.cli.main import main
from fived.testing import run_forked

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def fived(*args):
    """`python -m fived *args` in a real process, forked from this one: without its seconds of `import torch`."""
    return run_forked(main, list(args))


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_learns_logs_and_never_overwrites(tmp_path):
    out = str(tmp_path / "run")
    args = ["train", "--steps", "30", "--train.warmup_steps", "10", "--train.output_dir", out, "--report"]
    first = fived(*args)
    assert first.returncode == 0, first.stderr
    records = _losses(out)
    assert len(records) == 30
    # clearly learning: 5.57 -> 3.34 in 30 steps (3.07 in 60), a drop over twice the 1.0 asked for
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_mb"):
        assert key in records[0]
    assert "2 local rank(s)" in first.stdout and "dp/all_reduce" in first.stdout
    # a second run with the same output_dir goes next to it; the first run's log is untouched
    second = fived(*args[:2], "5", *args[3:])
    assert second.returncode == 0, second.stderr
    assert len(_losses(out)) == 30 and len(_losses(out + "-1")) == 5


def test_prepare_data_then_train_on_it(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    prep = fived("prepare-data", str(text), "--output", str(tmp_path / "tokens"))
    assert prep.returncode == 0, prep.stderr
    run = fived(
        "train",
        "--nproc",
        "1",
        "--steps",
        "50",
        "--train.warmup_steps",
        "5",
        "--data.path",
        str(tmp_path / "tokens.bin"),
        "--train.output_dir",
        str(tmp_path / "run"),
    )
    assert run.returncode == 0, run.stderr
    records = _losses(tmp_path / "run")
    assert records[-1]["loss"] < 1.0  # a repeated sentence is easy to learn (the bundled corpus: ~3)


def test_verify_cli_last_line_and_exit_code(tmp_path):
    (tmp_path / "run.toml").write_text("[train]\nsteps = 2\n")  # (a file's value sits above verify's 5 steps)
    res = fived("verify", "--dp", "2", "--model", "tiny", "--config", str(tmp_path / "run.toml"))
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr, res.stderr  # (its own defaults draw none: verify's warmup fits its steps)
    steps = [line.split()[0] for line in res.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert steps == ["1", "2"], res.stdout
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("max relative difference: ") and float(last.split(": ")[1]) <= 1e-9


def test_a_commands_defaults_read_a_bad_config_file_only_after_refusing_it_in_one_line(tmp_path):
    """`fived verify --config F` (a command with defaults of its own): F's values are read to keep them
    above the defaults, after F was checked (a malformed file: the one-line refusal, no traceback)."""
    from fived.config import ConfigError
    from fived.launch.run_setup import LaunchRequest, build_from_args

    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_from_args(LaunchRequest(config=str(bad)), {"train.steps": 5})
    with pytest.raises(ConfigError, match="file not found"):
        build_from_args(LaunchRequest(config=str(tmp_path / "absent.toml")), {"train.steps": 5})


def test_under_torchrun(tmp_path):
    """The same entry point joins the ranks torchrun started instead of starting its own."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fived",
            "train",
            "--steps",
            "3",
            "--train.output_dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(_losses(tmp_path / "run")) == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "bfloat16-autocast", "float64"])
def test_other_dtypes_train(tmp_path, dtype):
    # 10 steps: the loss falls 5.57 -> 4.85 in each dtype (3.68 at 20), every step lower than the last
    res = fived(
        "train",
        "--steps",
        "10",
        "--dtype",
        dtype,
        "--train.output_dir",
        str(tmp_path / "run"),
        "--train.activation_checkpointing",
        "selective",
    )
    assert res.returncode == 0, res.stderr
    records = _losses(tmp_path / "run")
    assert records[-1]["loss"] < records[0]["loss"]


def test_config_error_is_one_line_and_starts_nothing(tmp_path):
    res = fived("train", "--nproc", "3", "--dp", "2", "--train.output_dir", str(tmp_path / "run"))
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "parallel=" in res.stderr
    assert not (tmp_path / "run").exists()


def test_a_multi_token_prediction_preset_trains_and_reports(tmp_path):
    """tiny-deepseek-v3 as a user runs it, pipelined as `fived plan` proposes (pp2 x dp2): its MTP
    block's MoE has an expert load of its own ("mtp.0"), which the run's figures once sorted as a
    layer index (a traceback and exit 1 after every step had run)."""
    out = str(tmp_path / "run")
    args = ["--model", "tiny-deepseek-v3", "--nproc", "4", "--dp", "2", "--pp", "2", "--steps", "2"]
    res = fived("train", *args, "--train.warmup_steps", "1", "--train.output_dir", out)
    assert res.returncode == 0, res.stderr
    with open(os.path.join(out, "run.json")) as f:
        loads = list(json.load(f)["expert_load"])
    assert loads[-1] == "mtp.0" and loads[:-1] == sorted(loads[:-1], key=int) and len(loads) > 1
