"""Context parallelism's modes on CPU ranks: ring, Ulysses and hybrid (Ulysses pairs joined by a ring)
at cp=4, step time and peak memory per rank, measured against the planner's predictions.

The tiny model (4 query heads, 2 kv heads, which Ulysses over 4 ranks repeats to 4), global batch 1.
Step time: the three modes' Trainers side by side in one process group of 4 CPU ranks, timed steps
alternating (order reversed every other round, each after a barrier; `side_by_side.py`), a step's
time the slowest rank's, a mode's the median. Peak memory: each mode is a real `fived train` run in
fresh processes, as a user would start it,

    fived train --nproc 4 --cp 4 --parallel.cp_mode MODE --seq-len S --global-batch 1 --steps 2

and its metrics.jsonl's peak_mem_mb (the process's peak resident set: it includes the ~250 MB of
the Python/torch runtime, which the planner does not model). Predicted: `fived.planner.timing.step_time` and `fived.planner.memory.
memory_per_gpu` (less the GPU allocator reserve, which CPU ranks do not have) on `local_hardware` —
the numbers `fived plan` works with. The last lines compare how each mode's peak grows from the
shortest to the longest sequence, measured and predicted (the runtime's constant cancels).

    python benchmarks/bench_cp_modes.py                         # seq 8192 and 16384
    python benchmarks/bench_cp_modes.py --seq 2048 4096 --document-mask
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from side_by_side import interleaved_steps, slowest_median

MODES = (("ring", 2), ("ulysses", 2), ("hybrid", 2))
CP = 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--steps", type=int, default=4, help="timed steps per mode (after one warmup step)")
    p.add_argument(
        "--document-mask",
        action="store_true",
        help="documents of 64..1024 tokens (fived.testing.write_documents), masked",
    )
    return p.parse_args()


def overrides(mode: str, u: int, seq: int, steps: int, data: str) -> dict:
    out = {
        "parallel.nproc": CP,
        "parallel.cp": CP,
        "parallel.dp": 1,
        "parallel.cp_mode": mode,
        "parallel.cp_ulysses": u,
        "model.name": "tiny",
        "train.seq_len": seq,
        "train.global_batch": 1,
        "train.steps": steps,
        "train.warmup_steps": 1,
        "train.device": "cpu",
        "train.dtype": "float32",
    }
    if data:
        out.update({"data.path": data, "data.document_mask": True})
    return out


def peak_memory(over: dict, run_dir: Path) -> float:
    """Peak MB per rank of one `fived train` run."""
    cmd = [sys.executable, "-m", "fived", "train", "--nproc", str(CP), "--train.output_dir", str(run_dir)]
    for key, value in over.items():
        if key != "parallel.nproc":
            cmd += [f"--{key}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return max(r["peak_mem_mb"] for r in rows)


def rank_main(configs: list) -> list[float]:
    """This rank's seconds per timed step of each mode's Trainer (one process group)."""
    from fived.training.trainer import Trainer

    trainers = [Trainer(cfg, log=False) for cfg in configs]
    return interleaved_steps(trainers, warmup=1, steps=configs[0].train.steps - 1)[0]


def step_times(seq: int, args, data: str) -> list[float]:
    from fived.config import build_config
    from fived.launch.ranks import run_ranks

    configs = []
    for mode, u in MODES:
        over = overrides(mode, u, seq, args.steps + 1, data)
        configs.append(
            build_config(
                overrides={k: v for k, v in over.items() if k != "parallel.nproc"} | {"train.log_every": 10**9}
            )
        )
    ranks = run_ranks(CP, rank_main, configs, timeout_s=3600, device="cpu")
    return [slowest_median([r[j] for r in ranks]) for j in range(len(MODES))]


def predict(over: dict) -> tuple[float, float]:
    """(MB per rank, step seconds) the planner predicts for the run."""
    from fived.config import build_config
    from fived.layout.layout import Layout
    from fived.planner.hardware import local_hardware
    from fived.planner.memory import memory_per_gpu
    from fived.planner.timing import Cluster, step_time

    cfg = build_config(overrides={k: v for k, v in over.items() if k != "parallel.nproc" and not k.startswith("data.")})
    cfg.data.document_mask = "data.document_mask" in over
    layout, hw, t = Layout.from_config(cfg, CP), local_hardware(CP), cfg.train
    memory = memory_per_gpu(cfg.model, layout, t.seq_len, t.global_batch, t.dtype, hw.memory_gib)
    seconds = step_time(cfg.model, layout, Cluster(hw, CP, CP), t.seq_len, t.global_batch, t.dtype).total
    return (memory.total - memory.reserve) / 2**20, seconds


def main() -> None:
    args = parse_args()
    results = {}
    print(
        f"cp modes at cp={CP} | {CP} CPU ranks on {len(os.sched_getaffinity(0))} cores, gloo, OMP_NUM_THREADS=1 | "
        f"load {os.getloadavg()[0]:.2f} at start | tiny, float32, global batch 1"
        + (" | document masking" if args.document_mask else "")
    )
    print(f"{'seq':>6} {'mode':<9} {'peak MB/rank':>13} {'predicted MB':>13} {'step s':>8} {'predicted s':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        data = ""
        if args.document_mask:
            from fived.testing import write_documents

            data = write_documents(Path(tmp) / "docs.txt", lengths=(64, 256, 1024), total=8 * max(args.seq))
        for seq in args.seq:
            times = step_times(seq, args, data)
            for (mode, u), seconds in zip(MODES, times):
                over = overrides(mode, u, seq, 2, data)
                measured = peak_memory(over, Path(tmp) / f"s{seq}-{mode}"), seconds
                predicted = predict(over)
                results[seq, mode] = measured, predicted
                print(
                    f"{seq:>6} {mode:<9} {measured[0]:>13.0f} {predicted[0]:>13.0f} {measured[1]:>8.2f} "
                    f"{predicted[1]:>12.2f}",
                    flush=True,
                )
    for seq in args.seq:
        ring = results[seq, "ring"]
        print(
            f"seq {seq}: step time / ring's "
            + ", ".join(
                f"{mode} {results[seq, mode][0][1] / ring[0][1]:.2f}x measured, "
                f"{results[seq, mode][1][1] / ring[1][1]:.2f}x predicted"
                for mode, _ in MODES[1:]
            )
        )
    first, last = args.seq[0], args.seq[-1]
    if last != first:
        for mode, _ in MODES:
            (m0, p0), (m1, p1) = results[first, mode], results[last, mode]
            print(
                f"{mode}: peak memory grows by {m1[0] - m0[0]:.0f} MB from seq {first} to {last} measured, "
                f"{p1[0] - p0[0]:.0f} MB predicted"
            )


if __name__ == "__main__":
    main()
