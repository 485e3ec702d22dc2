"""Step metrics: device peak, peak memory, and the JSON-lines / TensorBoard log.

The FLOP count is fived.layout.flops'.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from fived.files import LOCK, MANIFEST, is_fived_dir, open_log, own_directory, write_file
from fived.training.tracker import Tracker
from fived.write_errors import WriteFailed, writing


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated GPU memory, or on CPU the process's peak resident set (includes the runtime).
    (By the run's device, not the host's: CPU ranks on a GPU host must not touch CUDA, e.g. forked.)"""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def fresh_output_dir(path: str) -> Path:
    """`path`, or `path-1`, `path-2`, ... if a previous run already wrote there (more than its
    manifest and lock): never over another run. (A directory fived did not make is refused when it
    is claimed, fived.files.claim_run_dir.)"""
    base = Path(path)
    candidate, n = base, 0
    while is_fived_dir(candidate) and any(p.name not in (MANIFEST, LOCK) for p in candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def keep_log_until(output_dir: str, step: int) -> None:
    """Keep the records up to `step` in a run's metrics.jsonl (a run resumed from the checkpoint of
    `step` logs the later steps again); the others move to metrics.superseded.jsonl (kept, not lost)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return
    lines = [line for line in path.read_bytes().decode(errors="replace").splitlines() if line.strip()]
    kept = [line for line in lines if _step_of(line) <= step]  # (a torn line: not kept, moved)
    if len(kept) == len(lines):
        return
    torn = sum(_step_of(line) == float("inf") for line in lines)
    if torn:
        print(
            f"fived: warning: {path}: {torn} torn line(s) (not a JSON record) moved to metrics.superseded.jsonl",
            file=sys.stderr,
        )
    with writing(path.with_name("metrics.superseded.jsonl")), open_log(output_dir, "metrics.superseded.jsonl") as f:
        f.writelines(line + "\n" for line in lines if _step_of(line) > step)
    with writing(path):
        write_file(output_dir, "metrics.jsonl", "".join(line + "\n" for line in kept))


def _step_of(line: str) -> float:
    """A metrics line's step; a torn line's is infinite (never kept as one of the steps)."""
    try:
        return json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return float("inf")


class MetricsLog:
    """JSON lines (one object per step) and, if asked and installed, TensorBoard scalars and the
    experiment tracker (`tracker`: its owner opens and closes it; every record written here reaches it)."""

    def __init__(self, output_dir: str, tensorboard: bool, tracker: Tracker | None = None):
        self.dir = Path(output_dir)
        self.tracker = tracker or Tracker()
        self.dir.mkdir(parents=True, exist_ok=True)
        with writing(self.dir / "metrics.jsonl"):
            self.file = open_log(self.dir, "metrics.jsonl")  # (whole lines; open for the run: close())
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(own_directory(self.dir, "tensorboard")))  # (its event files: new names)
            except ImportError:
                print(
                    "tensorboard is not installed (pip install tensorboard); logging JSON lines only", file=sys.stderr
                )

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:  # (a full disk, a filesystem turned read-only): one line, not a traceback
            raise WriteFailed("writing the metrics log", e, self.dir / "metrics.jsonl") from None
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])
        self.tracker.log(record)  # (never raises: a tracker's failure is a warning)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
