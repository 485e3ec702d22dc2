"""Context parallelism for a windowed layer: the halo exchange against the ring, on CPU ranks.

One attention layer of `--model` (its heads, kv heads and head size; float32, batch 1) at `--seq`
tokens over `--cp` gloo ranks in the halves layout, forward and backward, three ways:
  halo         the window `--window`, exchanging only the K/V the windows reach (what fived runs)
  masked ring  the same window on the masked ring (`ring_attention(..., halo=False)`): every block
               travels, those outside every window are skipped
  full ring    a global layer (window 0): the halves ring
Per way: the bytes a rank sends per step (the ledger's cp sends and key gathers, from fived's
communication layer, the busiest rank's), the attention compute per step (the rank's CPU seconds in
forward + backward, `time.thread_time`: waits and the machine's other load do not count; the
slowest rank's median) and the wall time (slowest rank, median). The ways run interleaved, order
reversed every other round, each after a barrier. The last lines hold the ratios halo / full ring
next to the planner's, for a one-layer model windowed against global: its bytes
(`fived.planner.communication.step_collectives`), its attention time (`fived.planner.timing.
attention_seconds` on this host's CPU entry: the FLOPs of the kernel calls fived makes, counted from
its tiles by `fived.layout.attention_tiles.window_pairs`) and the band's model FLOPs (MFU's count,
`fived.layout.flops.layer_keys`). `--heads`, `--kv-heads`, `--head-dim` change the layer's shape
(e.g. 8, 1, 64: a gpt-oss-120b attention layer's on one of tp 8 ranks).

    python benchmarks/bench_window_cp.py                              # cp 2, seq 16384, window 1024
    python benchmarks/bench_window_cp.py --seq 4096 --window 256      # quicker
    python benchmarks/bench_window_cp.py --heads 8 --kv-heads 1 --head-dim 64 --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

from fived.config import build_config
from fived.launch.ranks import run_ranks

WAYS = ("halo", "masked ring", "full ring")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--model", default="tiny-gpt-oss")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--heads", type=int, default=0, help="query heads (0: the model's)")
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (0: the model's)")
    p.add_argument("--head-dim", type=int, default=0, help="head size (0: the model's)")
    return p.parse_args()


def model_overrides(args) -> dict:
    """The model and the shape options given (build_config's overrides)."""
    shape = {"model.n_heads": args.heads, "model.n_kv_heads": args.kv_heads, "model.head_size": args.head_dim}
    return {"model.name": args.model, **{k: v for k, v in shape.items() if v}}


def _layer(args):
    """One call of the layer's attention, fwd + bwd, for each way; and its inputs."""
    from fived.model.attention import order_keys
    from fived.parallel.context import local_positions, ring_attention

    m = build_config(overrides=model_overrides(args)).model
    cp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    s = args.seq // cp
    q, dout = (torch.randn(1, m.n_heads, s, m.head_dim, generator=g) for _ in range(2))
    k, v = (torch.randn(1, m.n_kv_heads, s, m.head_dim, generator=g) for _ in range(2))
    keys = order_keys(None, local_positions(args.seq, cp, rank), 1)
    every = torch.stack([order_keys(None, local_positions(args.seq, cp, r), 1) for r in range(cp)])

    def run(way: str) -> None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if way == "full ring":
            out = ring_attention(*leaves, None, group)
        else:
            out = ring_attention(*leaves, keys, group, window=args.window, all_keys=every, halo=way == "halo")
        out.backward(dout)

    return run


def rank_main(args) -> dict:
    from fived.parallel import comm

    run = _layer(args)
    for _ in range(args.warmup):
        for way in WAYS:
            run(way)
    cpu: dict[str, list[float]] = {w: [] for w in WAYS}
    wall: dict[str, list[float]] = {w: [] for w in WAYS}
    sent: dict[str, int] = {}
    for i in range(args.steps):
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:
            recorder = comm.CommRecorder({dist.group.WORLD: "cp"}, timed=False)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            with comm.recording(recorder):
                run(way)
            cpu[way].append(time.thread_time() - start_cpu)
            wall[way].append(time.perf_counter() - start)
            sent[way] = sum(n for (_, op), n in recorder.bytes.items() if op != "recv")
    return {w: (statistics.median(cpu[w]), statistics.median(wall[w]), sent[w]) for w in WAYS}


def planned(args) -> tuple[float, float, float]:
    """The planner's ratios of the windowed layer to a global one: (bytes, attention seconds, band FLOPs)."""
    from fived.layout.flops import layer_keys
    from fived.layout.layout import Layout
    from fived.planner.communication import step_collectives
    from fived.planner.hardware import local_hardware
    from fived.planner.timing import Cluster, attention_seconds

    def priced(window: int) -> tuple[float, float]:
        cfg = build_config(
            overrides={
                **model_overrides(args),
                "model.n_layers": 1,
                "model.sliding_window": window,
                "model.window_pattern": "w",
                "parallel.cp": args.cp,
                "train.seq_len": args.seq,
                "train.global_batch": 1,
            }
        )
        cfg.model = dataclasses.replace(cfg.model, attention_sinks=False)
        layout = Layout.from_config(cfg, args.cp)
        calls = step_collectives(cfg.model, layout, args.seq, 1, "float32", [((0,), True, True)])
        sent = sum(c.nbytes * c.calls for c in calls if c.group == "cp" and c.op != "recv" and c.op != "all_reduce")
        cluster = Cluster(local_hardware(args.cp), args.cp, args.cp)
        return sent, attention_seconds(cfg.model, layout, cluster, args.seq, 1, "float32")

    (halo_sent, halo_s), (ring_sent, ring_s) = priced(args.window), priced(0)
    return halo_sent / ring_sent, halo_s / ring_s, layer_keys(args.window, args.seq) / args.seq


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
    print(
        f"{args.model} attention, cp {args.cp}, seq {args.seq}, window {args.window}, float32, batch 1 | "
        f"cpus {len(os.sched_getaffinity(0))} | load {load:.2f} at start"
    )
    ranks = run_ranks(args.cp, rank_main, args, timeout_s=600, deadline_s=3600, device="cpu")
    rows = {w: (max(r[w][0] for r in ranks), max(r[w][1] for r in ranks), max(r[w][2] for r in ranks)) for w in WAYS}
    print(f"{'way':<12} {'MB sent/step':>12} {'attention CPU s':>16} {'wall s':>8}")
    for way, (cpu, wall, sent) in rows.items():
        print(f"{way:<12} {sent / 1e6:>12.3f} {cpu:>16.3f} {wall:>8.3f}")
    bytes_ratio, time_ratio, band_ratio = planned(args)
    halo, ring = rows["halo"], rows["full ring"]
    print(f"halo / full ring: bytes {halo[2] / ring[2]:.4f} (planner {bytes_ratio:.4f}), ", end="")
    print(
        f"attention CPU {halo[0] / ring[0]:.3f} (planner {time_ratio:.3f}; the band's FLOPs {band_ratio:.3f}), ", end=""
    )
    print(f"wall {halo[1] / ring[1]:.3f}")
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
