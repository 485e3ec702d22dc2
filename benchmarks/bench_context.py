"""Context parallelism on CPU ranks: peak memory and step time of cp=2 against cp=1, same model and
tokens (the tiny model, global batch 1), at long sequences.

Each configuration is a real `fived train` run in fresh processes, as a user would start it:

    fived train --nproc C --cp C --seq-len S --global-batch 1 --steps 3

and the figures are read from its metrics.jsonl: peak_mem_mb (on CPU the process's peak resident
set, so it includes the ~250 MB of the Python/torch runtime) and step_time_s (the fastest step after
the first, which pays one-time start-up costs). The last lines are the ratios cp=2 / cp=1 and how
cp=2's peak grows from the shortest to the longest sequence (linear in the sequence: <= 2.2x per
doubling; the old ring of matmuls grew with its square).

    python benchmarks/bench_context.py                      # seq 8192 and 16384
    python benchmarks/bench_context.py --seq 2048 4096      # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=3)
    return p.parse_args()


def run(model: str, seq: int, cp: int, steps: int, out_dir: Path) -> tuple[float, float]:
    """(peak MB, step seconds) of one `fived train` run."""
    run_dir = out_dir / f"s{seq}-cp{cp}"
    cmd = [
        sys.executable,
        "-m",
        "fived",
        "train",
        "--nproc",
        str(cp),
        "--cp",
        str(cp),
        "--dp",
        "1",
        "--model.name",
        model,
        "--seq-len",
        str(seq),
        "--global-batch",
        "1",
        "--steps",
        str(steps),
        "--train.warmup_steps",
        "1",
        "--train.device",
        "cpu",
        "--train.output_dir",
        str(run_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return max(r["peak_mem_mb"] for r in rows), min(r["step_time_s"] for r in rows[1:])


def main() -> None:
    args = parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'seq':>6} {'cp':>3} {'peak MB/rank':>13} {'step s':>8}")
        for seq in args.seq:
            for cp in (1, 2):
                results[seq, cp] = run(args.model, seq, cp, args.steps, Path(tmp))
                print(f"{seq:>6} {cp:>3} {results[seq, cp][0]:>13.0f} {results[seq, cp][1]:>8.2f}", flush=True)
    for seq in args.seq:
        (m1, t1), (m2, t2) = results[seq, 1], results[seq, 2]
        print(f"seq {seq}: cp=2 / cp=1 peak memory per rank {m2 / m1:.2f}x, step time {t2 / t1:.2f}x")
    first, last = args.seq[0], args.seq[-1]
    if last != first:
        print(
            f"cp=2 peak memory grows {results[last, 2][0] / results[first, 2][0]:.2f}x from seq {first} "
            f"to {last} ({last / first:.0f}x the tokens)"
        )


if __name__ == "__main__":
    main()
