"""Time per (query, key) pair of a windowed layer's masked pieces against the causal fused kernel.

One process, one cp rank's tokens (halves layout, cp 2, seq 16384: 8192 tokens; window 1024), float32,
batch 1, forward + backward: the windowed pieces (`masked_block_forward`/`backward`, over the pairs
their tiles compute) and the causal kernel (`block_forward`/`backward`, over the causal half of the
square), each at 4 (2 kv) heads x 16 (tiny-gpt-oss) and 8 (1 kv) heads x 64; and what the masks cost
of it: taking every masked piece's mask twice from `piece_mask` (forward and backward, cache warm),
against building each from the comparisons (`_visible`, `_additive`) as every piece did before the
cache. CPU seconds of this thread (`time.thread_time`), median of `--repeats`.

    python benchmarks/bench_window_pieces.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from fived.model import attention
from fived.parallel.context import local_positions

SHAPES = ((4, 2, 16), (8, 1, 64))  # (heads, kv heads, head size)


def _seconds(run, repeats: int) -> float:
    run()  # (warm: kernels, the mask cache)
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        run()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    keys = attention.order_keys(None, local_positions(args.seq, args.cp, 0), 1)
    s = keys.shape[1]
    pieces = attention._pieces(keys, keys, args.window)
    masked = [(keys[0, q0:q1], keys[0, k0:k1]) for _, q0, q1, k0, k1, m in pieces if m]
    window_pairs, causal_pairs = sum((q1 - q0) * (k1 - k0) for _, q0, q1, k0, k1, _ in pieces), s * (s + 1) // 2
    print(
        f"{s} tokens, window {args.window}: {window_pairs / 1e6:.2f}M windowed pairs, {causal_pairs / 1e6:.2f}M causal"
    )
    print(f"load {os.getloadavg()[0]:.2f} at start; ns per pair, forward + backward:")

    def masks_cached():
        for qk, kk in masked + masked:
            attention.piece_mask(qk, kk, args.window, torch.float32)

    def masks_built():
        for qk, kk in masked + masked:
            attention._additive(attention._visible(qk, kk, args.window), torch.float32)

    mask_ns = [_seconds(f, args.repeats) / window_pairs * 1e9 for f in (masks_cached, masks_built)]
    print(f"masks: from the cache {mask_ns[0]:.2f}, built every time {mask_ns[1]:.2f}")
    for heads, kv_heads, dim in SHAPES:
        g = torch.Generator().manual_seed(0)
        q, dout = (torch.randn(1, heads, s, dim, generator=g) for _ in range(2))
        k, v = (torch.randn(1, kv_heads, s, dim, generator=g) for _ in range(2))
        scale = dim**-0.5

        def windowed(q=q, k=k, v=v, dout=dout, scale=scale):
            out, lse = attention.masked_block_forward(q, k, v, keys, keys, scale, args.window)
            attention.masked_block_backward(dout, q, k, v, out, lse, keys, keys, scale, args.window)

        def causal(q=q, k=k, v=v, dout=dout, scale=scale):
            out, lse = attention.block_forward(q, k, v, True, scale)[:2]
            attention.block_backward(dout, q, k, v, out, lse, True, scale)

        w, c = _seconds(windowed, args.repeats) / window_pairs, _seconds(causal, args.repeats) / causal_pairs
        print(f"{heads} ({kv_heads} kv) x {dim}: windowed pieces {w * 1e9:.1f}, causal kernel {c * 1e9:.1f}")
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
