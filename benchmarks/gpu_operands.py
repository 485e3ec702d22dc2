"""Do operand values change what `fived calibrate` measures? A linear layer's three GEMMs and causal
attention's forward + backward, timed as calibrate times them (rotating operand sets, queued calls),
on all-ones operands and on random ones, side by side in one process, alternating, at shapes a 1B-8B
model's layers produce (on CPU, small ones). An H200 ran constant operands 1.06-1.20x faster;
docs/gpu.md has the figures (2026-12-01). GEMM FLOPs: 6 x rows x width x depth (3 products);
attention: 7 x heads x seq^2 x head_dim (forward 2 and backward 5 products over the causal half;
calibrate's profile counts 12 x heads x seq^2 x head_dim, the whole score matrix).

    python benchmarks/gpu_operands.py                              # one CUDA GPU; ~40 s
    python benchmarks/gpu_operands.py --device cpu --seconds 0.5   # ~10 s
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from fived.tools import calibrate as cal

SHAPES = {  # (rows, width, depth) of the GEMMs, (seq, head_dim) of attention
    "cuda": (((8192, 2048, 2048), (8192, 8192, 2048), (32768, 4096, 8192)), ((4096, 128), (16384, 128))),
    "cpu": (((256, 256, 256), (1024, 512, 512)), ((256, 64), (1024, 64))),
}


def rates(values: str, device: torch.device, seconds: float) -> dict:
    """TFLOP/s of each shape with calibrate's operands made by `values` ('ones' or 'random')."""
    make = cal._ones if values == "ones" else cal._random
    real, cal._random = cal._random, make  # (calibrate's GEMMs and attention draw their operands here)
    try:
        out = {}
        gemms, attention = SHAPES[device.type]
        for r, w, d in gemms:
            out[f"gemm {r}x{w}x{d}"] = 6 * r * w * d / cal.linear_seconds(r, w, d, seconds, device) / 1e12
        heads = cal.attention_heads(device)
        for seq, hd in attention:
            flops = 7 * heads * seq * seq * hd  # (2 x seq^2 x hd per product, 7 products, half the matrix)
            out[f"attention seq {seq} hd {hd}"] = flops / cal.attention_seconds(seq, hd, heads, seconds, device) / 1e12
        return out
    finally:
        cal._random = real


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seconds", type=float, default=1.5, help="per shape and kind of operand, per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_operands: CUDA is absent on this machine; nothing was measured")
        return 0
    device = torch.device(args.device)
    runs: dict[str, list[dict]] = {"ones": [], "random": []}
    for i in range(args.rounds):  # (alternating, each first in turn: a drift in the clocks falls on both)
        for values in ("ones", "random") if i % 2 == 0 else ("random", "ones"):
            runs[values].append(rates(values, device, args.seconds))
    print(f"| shape | ones TFLOP/s | random TFLOP/s | ones / random |  ({args.rounds} rounds, mean)")
    print("|---|---|---|---|")
    result = {}
    for shape in runs["ones"][0]:
        ones, rand = (sum(r[shape] for r in runs[v]) / args.rounds for v in ("ones", "random"))
        result[shape] = {"ones": ones, "random": rand}
        print(f"| {shape} | {ones:.1f} | {rand:.1f} | {ones / rand:.3f} |")
    print(json.dumps({"report": "gpu_operands", "rates": result, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
