"""Step metrics: device peak, peak memory, and the JSON-lines / TensorBoard log.

The FLOP count is fived.layout.flops'.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated GPU memory, or on CPU the process's peak resident set (includes the runtime).
    (By the run's device, not the host's: CPU ranks on a GPU host must not touch CUDA, e.g. forked.)"""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def fresh_output_dir(path: str) -> Path:
    """`path`, or `path-1`, `path-2`, ... if a previous run already logged there: never overwrite."""
    base = Path(path)
    candidate, n = base, 0
    while (candidate / "metrics.jsonl").exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def keep_log_until(output_dir: str, step: int) -> None:
    """Keep the records up to `step` in a run's metrics.jsonl (a run resumed from the checkpoint of
    `step` logs the later steps again); the others move to metrics.superseded.jsonl (kept, not lost)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines(keepends=True) if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(kept) == len(lines):
        return
    from fived.write_errors import writing

    superseded = path.with_name("metrics.superseded.jsonl")
    with writing(superseded), open(superseded, "a") as f:
        f.writelines(line for line in lines if json.loads(line).get("step", 0) > step)
    tmp = path.with_name(path.name + ".tmp")
    with writing(tmp):
        tmp.write_text("".join(kept))
    os.replace(tmp, path)


class MetricsLog:
    """JSON lines (one object per step) and, if asked and installed, TensorBoard scalars."""

    def __init__(self, output_dir: str, tensorboard: bool):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.dir / "metrics.jsonl", "a")  # noqa: SIM115  (open for the run: close())
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:
                print(
                    "tensorboard is not installed (pip install tensorboard); logging JSON lines only", file=sys.stderr
                )

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:  # (a full disk, a filesystem turned read-only): one line, not a traceback
            from fived.write_errors import WriteFailed

            raise WriteFailed("writing the metrics log", e, self.dir / "metrics.jsonl") from None
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
