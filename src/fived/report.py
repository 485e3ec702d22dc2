"""`fived train --report`: what the ledger measured next to what the formulas say it should be."""
from __future__ import annotations

from fived.config import Config
from fived.mesh import DTYPES, Mesh
from fived.model import build_model
from fived.train import TrainResult

ADAM_STATES = 2  # exp_avg and exp_avg_sq, each the parameter's dtype


def expected_state_bytes(cfg: Config) -> dict[str, int]:
    """Model-state bytes per rank for replicated data parallelism (every rank holds everything):
    params N*b, grads N*b, optimizer 2*N*b, with b the parameter dtype's size (float32 for bf16 runs,
    which keep float32 weights)."""
    n = sum(p.numel() for p in build_model(cfg.model).parameters())
    b = 4 if DTYPES[cfg.train.dtype].itemsize == 2 else DTYPES[cfg.train.dtype].itemsize
    return {"params": n * b, "grads": n * b, "optimizer": ADAM_STATES * n * b}


def expected_comm_bytes(cfg: Config, world: int) -> dict[str, int]:
    """Per step: one all-reduce of every gradient over dp (when dp > 1)."""
    mesh = Mesh.from_config(cfg, world)
    grads = expected_state_bytes(cfg)["grads"]
    return {"dp/all_reduce": grads} if mesh.dp > 1 else {}


def format_report(cfg: Config, world: int, results: list[TrainResult]) -> str:
    lines = ["model-state bytes per rank (measured | formula):"]
    want = expected_state_bytes(cfg)
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
