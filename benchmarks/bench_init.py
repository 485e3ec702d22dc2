"""Time one rank's initialisation of a big model's shard (fived.model.init), in one process, no ranks.

The rank is tensor-parallel rank `--tp-rank` of pipeline stage `--stage` of a tp x pp layout (its
data-parallel ranks hold the same tensors before ZeRO-1/2 wraps them, or rows of them under
ZeRO-3 with `--zero3-dp`). Its placements are written here by fived's tensor-parallel rules
(column-parallel wq/wk/wv/w1/w3 and the vocab-padded embedding and head, row-parallel wo/w2), its
storage is allocated in `--dtype` and filled as the trainer fills it; the table reports elements
held, generated (whole tiles), tiles, seconds and generated elements per second.

    python benchmarks/bench_init.py                                 # llama3-70b tp8 pp8, stage 0
    python benchmarks/bench_init.py --model llama3-405b --layers 2  # a slice of a 405b stage
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from fived.config import model_preset
from fived.layout.placement import Box, Placement
from fived.model.init import TileFiller, TileSeeds, model_shapes, std_of

COLUMN_PARALLEL = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "w1.weight", "w3.weight")


def placement(name: str, shape: tuple[int, ...], tp: int, rank: int, dp: int, dp_rank: int) -> Placement:
    offsets, sizes = [0] * len(shape), list(shape)
    dim = None
    if name.endswith(COLUMN_PARALLEL) or name in ("tok_embeddings.weight", "output.weight"):
        dim = 0
    elif name.endswith(("attention.wo.weight", "w2.weight")):
        dim = 1
    if dim is not None:
        sizes[dim] = math.ceil(shape[dim] / tp)  # (the vocabulary padded to a multiple of tp)
        offsets[dim] = rank * sizes[dim]
    rows = None
    if dp > 1:  # ZeRO-3: FSDP2's ceil-sized row chunks of the local tensor
        chunk = math.ceil(sizes[0] / dp)
        rows = (min(dp_rank * chunk, sizes[0]), min((dp_rank + 1) * chunk, sizes[0]))
    return Placement(tuple(shape), Box(tuple(offsets), tuple(sizes)), rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--zero3-dp", type=int, default=1, help="ZeRO-3 over this many ranks (rows of each tensor)")
    ap.add_argument("--layers", type=int, default=0, help="only this many of the stage's layers (0: all)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    cfg = model_preset(args.model)
    shapes = model_shapes(cfg)
    per_stage = cfg.n_layers // args.pp
    layers = range(args.stage * per_stage, (args.stage + 1) * per_stage)
    if args.layers:
        layers = layers[: args.layers]
    keep = {f"layers.{i}." for i in layers}
    names = [n for n in shapes if any(n.startswith(k) for k in keep)]
    if args.stage == 0:
        names.insert(0, "tok_embeddings.weight")
    if args.stage == args.pp - 1:
        names += ["norm.weight", "output.weight"]

    filler = TileFiller(TileSeeds(shapes, seed=0))
    dtype = getattr(torch, args.dtype)
    held, seconds = 0, 0.0
    for name in names:
        where = placement(name, shapes[name], args.tp, args.tp_rank, args.zero3_dp, 0)
        stored = torch.empty(where.stored_shape, dtype=dtype)
        held += stored.numel()
        start = time.perf_counter()
        filler.fill(name, shapes[name], std_of(name, cfg), where.pieces(stored))
        seconds += time.perf_counter() - start
        del stored
    s = filler.stats
    print(
        f"{args.model} tp{args.tp} pp{args.pp} stage {args.stage} tp rank {args.tp_rank}"
        f"{f' zero3 dp{args.zero3_dp}' if args.zero3_dp > 1 else ''}: {len(names)} tensors, {args.dtype}"
    )
    print(
        f"held {held / 1e9:.3f} G elements, generated {s.generated / 1e9:.3f} G in {s.tiles} tiles "
        f"(x{s.generated / held:.3f} of held), {seconds:.2f} s, {s.generated / seconds / 1e6:.0f} M generated/s, "
        f"{held / seconds / 1e6:.0f} M held/s"
    )


if __name__ == "__main__":
    main()
