"""`fived train --report`: what the ledger measured next to what the formulas say it should be.

Model-state bytes per rank, N parameters of b bytes (b = 4 for float32 and for bfloat16 runs, which
keep float32 weights; 8 for float64), S = dp_shard, Adam keeps two states per parameter:

    stage   params   grads    optimizer      per parameter, float32 / bf16-autocast weights
    ZeRO-0  N b      N b      2 N b          16
    ZeRO-1  N b      N b      2 N b / S      8 + 8/S
    ZeRO-2  N b      N b / S  2 N b / S      4 + 12/S
    ZeRO-3  N b / S  N b / S  2 N b / S      16/S

(The textbook's bf16 figures — 16, 4 + 12/N, 2 + 14/N, 16/N — assume bf16 weights beside a float32
master copy; fived keeps float32 weights and computes in bf16 under autocast, so its bf16 runs have
the float32 figures above.) Shards are padded to equal length, so a rank may hold slightly less.

Communication per step, P = N padded to a multiple of S, r = bytes of the reduction dtype:
    ZeRO-0  all-reduce N r over dp (in buckets, during backward)
    ZeRO-1/2  reduce-scatter P r + all-gather P b over dp_shard, an 8-byte all-reduce of the
            squared gradient norm; with replicas an all-reduce of P r / S over dp_replicate
    ZeRO-3  per micro-batch an all-gather of every parameter for forward and of every block again
            for backward (with zero3_keep_gathered: every parameter once per step), reduce-scatter
            P r once, and the 8-byte norm all-reduce
"""
from __future__ import annotations

import math

from fived.config import Config
from fived.mesh import DTYPES, Mesh
from fived.model import build_model
from fived.train import TrainResult


def _sizes(cfg: Config) -> tuple[list, int, int]:
    """(parameter shapes with their FSDP-block flag, bytes per weight, bytes per reduced gradient)"""
    model = build_model(cfg.model)
    shapes = [(p.shape, name.startswith("layers.")) for name, p in model.named_parameters()]
    bf16 = cfg.train.dtype == "bfloat16"
    b = 4 if bf16 else DTYPES[cfg.train.dtype].itemsize
    r = DTYPES[cfg.parallel.reduce_dtype].itemsize if bf16 else b
    return shapes, b, r


def expected_state_bytes(cfg: Config, world: int) -> dict[str, int]:
    """The table above for this config (per rank, before shard padding)."""
    shapes, b, _ = _sizes(cfg)
    n = sum(math.prod(s) for s, _ in shapes)
    shards = Mesh.from_config(cfg, world).dp_shard
    stage = cfg.parallel.zero
    sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}[stage]
    full = {"params": n * b, "grads": n * b, "optimizer": 2 * n * b}
    return {k: (v // shards if k in sharded else v) for k, v in full.items()}


def expected_comm_bytes(cfg: Config, world: int) -> dict[str, int]:
    """The communication formulas above, keyed like the ledger ("dim/collective")."""
    mesh = Mesh.from_config(cfg, world)
    shapes, b, r = _sizes(cfg)
    n = sum(math.prod(s) for s, _ in shapes)
    s_, stage = mesh.dp_shard, cfg.parallel.zero
    if mesh.dp == 1:
        return {}
    shard_dim = "dp" if mesh.dp_replicate == 1 else "dp_shard"
    out: dict[str, int] = {}
    if stage == 0:
        out["dp/all_reduce"] = n * r
    elif stage in (1, 2):
        padded = math.ceil(n / s_) * s_
        out[f"{shard_dim}/reduce_scatter_single"] = padded * r
        out[f"{shard_dim}/all_gather_single"] = padded * b
        out[f"{shard_dim}/all_reduce"] = 8
        if mesh.dp_replicate > 1:
            out["dp_replicate/all_reduce"] = padded // s_ * r
    else:
        # FSDP2 pads each parameter's first dimension to a multiple of S.
        padded = [math.ceil(s[0] / s_) * s_ * math.prod(s[1:]) for s, _ in shapes]
        blocks = sum(p for p, (_, in_block) in zip(padded, shapes) if in_block)
        if cfg.parallel.zero3_keep_gathered:  # gathered once, kept through every micro-batch
            out[f"{shard_dim}/all_gather_single"] = sum(padded) * b
        else:  # per micro-batch: everything for forward, the blocks again for backward
            out[f"{shard_dim}/all_gather_single"] = cfg.train.microbatches * (sum(padded) + blocks) * b
        out[f"{shard_dim}/reduce_scatter_single"] = sum(padded) * r
        out[f"{shard_dim}/all_reduce"] = 8  # the squared gradient norm
        if mesh.dp_replicate > 1:
            out["dp_replicate/all_reduce"] = sum(padded) // s_ * r
    return out


def format_report(cfg: Config, world: int, results: list[TrainResult]) -> str:
    lines = [f"model-state bytes per rank, ZeRO-{cfg.parallel.zero} (measured | formula):"]
    want = expected_state_bytes(cfg, world)
    for rank, res in enumerate(results):
        cells = [f"{k} {res.memory.get(k, 0):,} | {want[k]:,}" for k in ("params", "grads", "optimizer")]
        lines.append(f"  rank {rank}: " + "; ".join(cells))
    lines.append("communication per step on rank 0, by mesh dimension (measured bytes, calls | formula bytes):")
    want_comm = expected_comm_bytes(cfg, world)
    comm = results[0].comm
    for key in sorted(set(comm) | set(want_comm)):
        got = comm.get(key, {"bytes": 0, "calls": 0})
        lines.append(f"  {key}: {got['bytes']:,} B in {got['calls']} call(s) | {want_comm.get(key, 0):,} B")
    if not comm and not want_comm:
        lines.append("  (none: a single rank)")
    return "\n".join(lines)
