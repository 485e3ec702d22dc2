"""Steps/s of tp=2 + sp with `parallel.tp_overlap` off and on (a timing script, not a test).

Runs `fived train --nproc 2 --tp 2 --sp` on the `tiny` model widened (dim 512, ffn 1024, 8 heads)
for each setting, alternating, and reports the median step time of the steps after the first few
(start-up), with the step breakdown's exposed and overlapped tp communication.

    OMP_NUM_THREADS=1 python3 benchmarks/bench_tp_overlap.py [--steps 20] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

WIDE = ["--model.dim", "512", "--model.ffn_dim", "1024", "--model.n_heads", "8"]
SKIP = 3  # steps of start-up left out


def run(overlap: bool, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "fived", "train", "--nproc", "2", "--model", "tiny", "--tp", "2", "--sp",
               "--parallel.tp_overlap", str(overlap).lower(), "--steps", str(steps), "--train.warmup_steps", "1",
               "--train.output_dir", out, *WIDE, *extra]
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][SKIP:]
    step = statistics.median(r["step_time_s"] for r in rows)
    exposed = statistics.median(r["breakdown"]["components"].get("comm_tp", 0.0) for r in rows)
    hidden = statistics.median(r["breakdown"]["overlapped"].get("tp", 0.0) for r in rows)
    return {"step_s": step, "steps_per_s": 1 / step, "tp_exposed_s": exposed, "tp_overlapped_s": hidden}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    args, extra = parser.parse_known_args()
    results = {False: [], True: []}
    for _ in range(args.repeats):
        for overlap in (False, True):
            results[overlap].append(run(overlap, args.steps, extra))
    for overlap, runs in results.items():
        best = min(runs, key=lambda r: r["step_s"])
        print(f"tp_overlap={str(overlap).lower():5}  {best['steps_per_s']:.2f} steps/s  "
              f"(median step {best['step_s'] * 1e3:.0f} ms; tp exposed {best['tp_exposed_s'] * 1e3:.0f} ms, "
              f"overlapped {best['tp_overlapped_s'] * 1e3:.0f} ms; best of {len(runs)})")


if __name__ == "__main__":
    main()
