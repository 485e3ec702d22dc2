"""`fived dryrun` on real shapes, on this machine's CPU: activation bytes of real-size transformer
blocks (measured by `--blocks` vs the planner's), and the build time and peak memory of one rank of
a 70B layout.

Each row is one `fived dryrun` in a subprocess of its own (peak RSS is per process). The activation
rows pick a pipeline depth that leaves the rank one or two layers, so its model state stays small;
a block's activations do not depend on the pipeline.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_dryrun.py [--only NAME] [--skip-init]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
BLOCKS = {
    "llama3-8b seq 8192 tp1": "--model llama3-8b --seq-len 8192 --pp 32 --dp 2 --zero 1 --dtype bfloat16 --nproc 64 "
    "--global-batch 64 --rank 2 --blocks 1",
    "llama3-8b seq 8192 tp4+sp": "--model llama3-8b --seq-len 8192 --tp 4 --sp --pp 32 --dp 2 --zero 1 --dtype bfloat16 "
    "--nproc 256 --global-batch 64 --rank 8 --blocks 1",
    "mixtral-8x7b seq 4096 ep8": "--model mixtral-8x7b --seq-len 4096 --ep 8 --pp 32 --dp 8 --zero 1 --dtype bfloat16 "
    "--nproc 256 --global-batch 256 --rank 8 --blocks 1",
}
L70 = (
    "--model llama3-70b --seq-len 8192 --tp 8 --pp 8 --dp 8 --zero 1 --dtype bfloat16 --nproc 512 "
    "--global-batch 64 --rank 0"
)
BUILDS = {"llama3-70b tp8 pp8 dp8 ZeRO-1 bf16, rank 0": L70, "llama3-70b ... rank 0, --no-init": L70 + " --no-init"}


def dryrun(flags: str) -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fived", "dryrun", *flags.split()], env=env, capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"fived dryrun {flags} failed:\n{done.stderr[-3000:]}")
    return done.stdout, time.perf_counter() - start


def figures(out: str) -> dict:
    built, step, built_rss, rss = re.search(
        r"built in ([\d.]+) s .*first optimizer step ([\d.]+) s; peak RSS "
        r"([\d.]+) GiB after the build, ([\d.]+) GiB in all",
        out,
    ).groups()
    layers = [
        (int(a.replace(",", "")), int(b.replace(",", "")))
        for a, b in re.findall(r"layer \d+: ([\d,]+) \| ([\d,]+)", out)
    ]
    verdict = re.search(r"measured (\d+), planner (\d+)$", out.strip()).groups()
    return {
        "build_s": float(built),
        "step_s": float(step),
        "build_gib": float(built_rss),
        "rss_gib": float(rss),
        "layers": layers,
        "state_equal": verdict[0] == verdict[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the rows whose name contains this")
    parser.add_argument("--skip-init", action="store_true", help="skip the 70B build with init (the slow row)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load:.1f}; "
        f"OMP_NUM_THREADS=1"
    )
    print(
        f"{'row':<52}{'measured B':>16}{'planner B':>16}{'error':>8}{'build s':>9}{'step s':>8}{'wall s':>8}"
        f"{'build GiB':>10}{'peak GiB':>10}"
    )
    rows = {**BLOCKS, **BUILDS}
    for name, flags in rows.items():
        if (args.only and args.only not in name) or (args.skip_init and name.endswith("rank 0")):
            continue
        out, wall = dryrun(flags)
        f = figures(out)
        got, want = (sum(x) for x in zip(*f["layers"])) if f["layers"] else (0, 0)
        err = f"{(got - want) / want:+.2%}" if want else "-"
        cells = f"{got:>16,}{want:>16,}{err:>8}" if want else f"{'-':>16}{'-':>16}{'-':>8}"
        print(
            f"{name:<52}{cells}{f['build_s']:>9.1f}{f['step_s']:>8.1f}{wall:>8.1f}{f['build_gib']:>10.2f}{f['rss_gib']:>10.2f}"
            + ("" if f["state_equal"] else "  MODEL STATE DIFFERS"),
            flush=True,
        )
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
