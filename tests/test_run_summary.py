"""What `fived train` says, the same under both launchers (its own ranks and torchrun's): the header,
then the run's figures — means over the launch's steps after the first few (not the last step's
figure), the loss first -> last, the time, the checkpoints saved — each recomputed here from
metrics.jsonl."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fived.launch.run_summary import WARMUP_STEPS_EXCLUDED, summarise

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
FLAGS = [
    "--steps",
    "8",
    "--seq-len",
    "16",
    "--global-batch",
    "4",
    "--train.warmup_steps",
    "2",
    "--checkpoint.every",
    "3",
]


def test_means_are_the_runs_not_the_last_steps():
    records = [
        {"step": s, "loss": 6.0 - s, "tokens_per_s": 1000.0 / t, "mfu": 0.01 / t, "step_time_s": t}
        for s, t in enumerate([9.0, 3.0, 2.0, 1.0, 1.0, 2.0, 0.5], start=1)
    ]
    summary = summarise(records, "runs/x", wall_s=30.0, checkpoints=[3, 6, 7])
    assert summary.counted_from == 1 + WARMUP_STEPS_EXCLUDED == 4
    assert summary.tokens_per_s == pytest.approx(4 * 1000 / 4.5)  # the steps' tokens over their time
    assert summary.mfu == pytest.approx(4 * 0.01 / 4.5) and summary.step_time_s == pytest.approx(4.5 / 4)
    assert summary.tokens_per_s != records[-1]["tokens_per_s"]  # (the issue: the last step's 2000 was printed)
    assert (summary.loss_first, summary.loss_last, summary.first_step, summary.last_step) == (5.0, -1.0, 1, 7)
    short = summarise(records[:2], "runs/x", wall_s=1.0, checkpoints=[])
    assert short.counted_from == 2 and "no checkpoint saved" in short.lines()[0]  # (at least one step counted)


def _launch(launcher: str, run_dir: Path) -> subprocess.CompletedProcess:
    fived = ["-m", "fived", "train", *FLAGS, "--train.output_dir", str(run_dir)]
    if launcher == "torchrun":
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *fived]
    else:
        args = [sys.executable, *fived, "--nproc", "2"]
    out = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_header_and_summary_under_both_launchers(launcher, tmp_path):
    run_dir = tmp_path / "run"
    lines = [line for line in _launch(launcher, run_dir).stdout.splitlines() if line.strip()]
    said = "local rank(s)" if launcher == "local" else "rank(s) under torchrun"
    assert lines[0] == (
        f"fived train: model tiny, 2 {said}, layout dp=2 tp=1 pp=1 cp=1 ep=1 zero=0, 8 steps -> {run_dir}/metrics.jsonl"
    )  # (said once: by the launcher, or by torchrun's rank 0)
    assert lines[1] == "  lr 0.003 (warmup 2, cosine decay to step 8, to 0.0003); 4 x 16 tokens per step, float32"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected = summarise(records, str(run_dir), wall_s=0.0, checkpoints=[3, 6, 8])
    first, means = lines[-2:]
    head = re.fullmatch(r"fived train: 8 step\(s\) \(1-8\) in ([\d.]+) s; loss (\S+) -> (\S+); (.*)", first)
    assert head, first
    assert (head.group(2), head.group(3)) == (f"{records[0]['loss']:.4f}", f"{records[-1]['loss']:.4f}")
    assert head.group(4) == f"3 checkpoint(s) saved (steps 3, 6, 8) in {run_dir}/checkpoints"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-3", "step-6", "step-8"]
    assert 0 < float(head.group(1)) < 300
    assert means == (
        f"  mean over steps 4-8, the first 3 excluded: {expected.tokens_per_s:,.0f} tokens/s, "
        f"MFU {expected.mfu:.1%}, {expected.step_time_s:.3g} s/step"
    )
    assert sum(line.startswith("fived train: ") for line in lines) == 2  # one header, one summary
    assert (run_dir / "run.json").is_file()  # (what `fived report` reads: written under both launchers)
