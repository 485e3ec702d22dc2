"""Compiled vs eager training, and the grouped experts vs the loop they replaced; one CPU rank.

1. `fived train` on one rank, eager and with `--train.compile true` (inductor: each transformer
   block compiled on its own): the step time is the fastest step after the first three (the first
   compiled step pays the compilation, reported separately).
2. One MoE layer (router, dispatch, experts, combine) forward + backward, with its experts run by
   the grouped op (`fived.model.grouped_gemm`: one batched call) and by the former per-expert loop
   (`expert_loop`), same weights and tokens, run alternately; the fastest of the repetitions (the machine is shared).

The last lines are the ratios (below 1: the new path is faster).

    python benchmarks/bench_compile.py
    python benchmarks/bench_compile.py --dim 128 --seq 256     # quicker
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from fived.config import build_config
from fived.model.grouped_gemm import expert_loop
from fived.model.transformer import GroupedExperts, MoE


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--moe-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=10)
    return p.parse_args()


def train_step_times(args, compiled: bool, out: Path) -> list[float]:
    run_dir = out / ("compiled" if compiled else "eager")
    heads = max(args.dim // 64, 2)
    cmd = [
        sys.executable,
        "-m",
        "fived",
        "train",
        "--nproc",
        "1",
        "--model.name",
        "tiny",
        "--model.dim",
        str(args.dim),
        "--model.n_layers",
        str(args.layers),
        "--model.n_heads",
        str(heads),
        "--model.n_kv_heads",
        str(heads // 2),
        "--model.ffn_dim",
        str(args.dim * 8 // 3 // 64 * 64),
        "--seq-len",
        str(args.seq),
        "--global-batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--train.warmup_steps",
        "1",
        "--train.device",
        "cpu",
        "--train.output_dir",
        str(run_dir),
        "--train.compile",
        str(compiled).lower(),
    ]
    subprocess.run(
        cmd,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return [json.loads(line)["step_time_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class LoopedExperts(GroupedExperts):
    """The experts as they ran before the grouped op: a loop of per-expert GEMMs (host counts)."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return expert_loop(x, self.w1, self.w3, self.w2, counts.tolist())


def moe_step_times(args) -> tuple[float, float]:
    """(loop, grouped) seconds per forward + backward of one MoE layer: the two layers share weights
    and tokens and run alternately (so both see the same machine load); the fastest repetition."""
    cfg = build_config(
        overrides={
            "model.name": "tiny-moe",
            "model.dim": args.dim,
            "model.n_experts": args.experts,
            "model.moe_ffn_dim": args.dim * 2,
            "model.n_shared_experts": 0,
        }
    ).model
    torch.manual_seed(0)
    grouped = MoE(cfg)
    for p in grouped.parameters():
        torch.nn.init.normal_(p, std=0.02)
    looped = copy.deepcopy(grouped)
    looped.experts = LoopedExperts(cfg.n_experts, cfg.dim, cfg.expert_dim)
    looped.experts.load_state_dict(grouped.experts.state_dict())
    x = torch.randn(1, args.moe_tokens, cfg.dim, requires_grad=True)
    times = {"loop": [], "grouped": []}
    for i in range(args.repeats + 1):
        for name, layer in (("loop", looped), ("grouped", grouped)):
            start = time.perf_counter()
            layer(x).square().sum().backward()
            if i >= 1:
                times[name].append(time.perf_counter() - start)
    return min(times["loop"]), min(times["grouped"])


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        eager = train_step_times(args, False, Path(tmp))
        compiled = train_step_times(args, True, Path(tmp))
    e_step, c_step = min(eager[3:]), min(compiled[3:])
    print(
        f"train step, dim {args.dim} x {args.layers} layers, {args.batch} x {args.seq} tokens: eager {e_step:.3f} s, "
        f"compiled {c_step:.3f} s (first compiled step {compiled[0]:.1f} s, eager {eager[0]:.2f} s)"
    )
    loop, grouped = moe_step_times(args)
    print(
        f"MoE layer fwd+bwd, {args.experts} experts top-2, {args.moe_tokens} tokens, dim {args.dim}: "
        f"loop {loop * 1e3:.1f} ms, grouped {grouped * 1e3:.1f} ms"
    )
    print(f"compiled / eager step time: {c_step / e_step:.2f}x")
    print(f"grouped / loop MoE layer time: {grouped / loop:.2f}x")


if __name__ == "__main__":
    main()
