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

from fived.activation_model import activation_bytes, layer_bytes
from fived.config import Config
from fived.mesh import DTYPES, Mesh
from fived.model import build_model
from fived.parallel.expert import apply_expert_parallel
from fived.parallel.tensor import TensorParallel
from fived.train import TrainResult


def _sizes(cfg: Config, world: int) -> tuple[list, int, int]:
    """(this rank's parameter shapes with their FSDP-block flag, bytes per weight, bytes per reduced
    gradient). With tensor parallelism the shapes are the local shards (rank 0's; all are equal)."""
    model = local_model(cfg, world)
    shapes = [(p.shape, name.startswith("layers.")) for name, p in model.named_parameters()]
    return (shapes,) + _dtype_bytes(cfg)


def _dtype_bytes(cfg: Config) -> tuple[int, int]:
    """(bytes per weight, bytes per reduced gradient): bf16 runs keep float32 weights."""
    from fived.planner.memory import WEIGHT_BYTES

    b = WEIGHT_BYTES[cfg.train.dtype]
    return b, (DTYPES[cfg.parallel.reduce_dtype].itemsize if cfg.train.dtype == "bfloat16" else b)


def expected_state_bytes(cfg: Config, world: int, rank: int = 0) -> dict[str, int]:
    """The table above for global rank `rank`, exactly (the planner's model-state formula: this
    rank's pipeline stages, its ZeRO slice or FSDP2 rows over S = dp_shard x cp; with expert
    parallelism its E/ep experts sharded over edp = dp*cp/ep by ZeRO-3 and kept whole by 0/1/2)."""
    from fived.mesh import Layout
    from fived.planner.memory import rank_chunks, state_bytes

    layout = Layout.from_config(cfg, world)
    where = layout.coordinates(rank)
    return state_bytes(cfg.model, layout, cfg.train.dtype, rank_chunks(cfg.model, layout, where["pp"]),
                       where["shard"], where["edp"])


def local_model(cfg: Config, world: int):
    model = build_model(cfg.model)
    mesh = Mesh.from_config(cfg, world)
    if mesh.tp > 1:
        TensorParallel(model, None, cfg.parallel.sp, mesh.tp, 0).apply(model)
    if mesh.ep > 1:
        apply_expert_parallel([model], None, mesh.ep, 0)
    return model


def expected_comm_bytes(cfg: Config, world: int) -> dict[str, int]:
    """The communication formulas above, keyed like the ledger ("dim/collective")."""
    mesh = Mesh.from_config(cfg, world)
    shapes, b, r = _sizes(cfg, world)
    n = sum(math.prod(s) for s, _ in shapes)
    s_, stage = mesh.dp_shard, cfg.parallel.zero
    out = expected_tp_comm_bytes(cfg, world) if mesh.tp > 1 else {}
    if mesh.dp == 1:
        return out
    shard_dim = "dp" if mesh.dp_replicate == 1 else "dp_shard"
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
        g = 2 if cfg.train.dtype == "bfloat16" else b  # FSDP2 gathers in the compute dtype
        if cfg.parallel.zero3_keep_gathered:  # gathered once, kept through every micro-batch
            out[f"{shard_dim}/all_gather_single"] = sum(padded) * g
        else:  # per micro-batch: everything for forward, the blocks again for backward
            out[f"{shard_dim}/all_gather_single"] = cfg.train.microbatches * (sum(padded) + blocks) * g
        out[f"{shard_dim}/reduce_scatter_single"] = sum(padded) * r
        out[f"{shard_dim}/all_reduce"] = 8  # the squared gradient norm
        if mesh.dp_replicate > 1:
            out["dp_replicate/all_reduce"] = sum(padded) // s_ * r
    return out


def expected_tp_comm_bytes(cfg: Config, world: int) -> dict[str, int]:
    """Tensor-parallel bytes per step, B tokens per micro-batch, h = dim, e = activation bytes:
    per layer and micro-batch, without SP two all-reduces of B*h*e forward (region exits) and two
    backward (region entries); with SP the same volume as all-gathers + reduce-scatters, plus one
    all-gather per region in backward to rebuild the input it did not keep. Besides the layers: the
    vocab-parallel embedding's exit and the output head's entry (one region boundary each), the
    loss's three all-reduces of B values (max, sum of exponentials, target logit), the partial
    gradients summed over tp (router; norms with SP; replicated kv heads), the 8-byte norm."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    mesh = Mesh.from_config(cfg, world)
    e = DTYPES[t.dtype].itemsize
    tokens = t.global_batch // mesh.dp // t.microbatches * t.seq_len
    act = tokens * m.dim * e
    loss = 3 * tokens * max(e, 4) * t.microbatches
    layers = m.n_layers * t.microbatches
    out = {"tp/all_reduce": loss + 8}
    if p.sp:
        out["tp/all_gather_single"] = (6 * layers + 3 * t.microbatches) * act
        out["tp/reduce_scatter_single"] = (4 * layers + 2 * t.microbatches) * act
        out["tp/all_reduce"] += (2 * m.n_layers + 1) * m.dim * e  # norm gains saw different tokens
    else:
        out["tp/all_reduce"] += (4 * layers + 2 * t.microbatches) * act
    n_moe = m.n_layers - m.n_dense_layers if m.is_moe else 0
    out["tp/all_reduce"] += n_moe * m.n_experts * m.dim * e  # the router's partial gradient
    if m.n_kv_heads % mesh.tp:  # replicated kv heads: a [kv heads, head_dim, dim] slot tensor each
        out["tp/all_reduce"] += m.n_layers * 2 * m.n_kv_heads * m.head_dim * m.dim * e
    return out


def _activation_layout(cfg: Config, world: int) -> dict:
    """The layout arguments of `fived.activation_model.activation_bytes` for this config."""
    t, p = cfg.train, cfg.parallel
    mesh = Mesh.from_config(cfg, world)
    return dict(micro_batch_seqs=t.global_batch // mesh.dp // t.microbatches, seq_len=t.seq_len, tp=mesh.tp,
                sp=p.sp, cp=mesh.cp, ep=mesh.ep, dtype_bytes=DTYPES[t.dtype].itemsize,
                checkpointing=t.activation_checkpointing)


def expected_activation_bytes(cfg: Config, world: int) -> int:
    """Bytes one dense transformer layer saves for backward per micro-batch on one rank (the
    formula of `fived.activation_model`, which documents every term), for our architecture
    (RMSNorm, GQA, SwiGLU, SDPA keeping only its log-sum-exp; the Korthikanti et al. count redone).
    Per token, in elements, without checkpointing: each RMSNorm keeps its input, the normalised
    input and its output (3h, twice), plus 1/rms; attention keeps q and its output (2h), k and v
    (2 h_kv) and a log-sum-exp per head (a); SwiGLU keeps gate, up, silu(gate) and their product
    (4f). Per layer the RoPE tables (2 s head_dim). Tensor parallelism divides q, attention output,
    the heads and the MLP by T; sequence parallelism also divides the norms' part; kv heads are
    divided while T <= n_kv_heads and one head is kept otherwise; B counts this rank's tokens
    (seq_len / cp of each sequence; ring attention also keeps the s/cp global positions):
        B*e*(6h/T_sp + 2/T_sp + (2h + 4f + a)/T + 2 h_kv_local) + 2*s*head_dim*e"""
    return layer_bytes(cfg.model, moe=False, **_activation_layout(cfg, world))


def expected_activations(cfg: Config, world: int, rank: int = 0) -> dict[str, int]:
    """{part: bytes saved for backward per micro-batch} on global rank `rank`: its layers (all
    of them, or its pipeline stages'), "embedding" and "head" where it holds them."""
    from fived.parallel.pipeline import split_layers, stage_rank, stages_per_rank

    p = cfg.parallel
    layers, first, last = list(range(cfg.model.n_layers)), True, True
    if p.pp > 1:
        pp_rank = rank // (world // p.pp)  # pp is the outermost mesh dimension
        n_stages = p.pp * stages_per_rank(p.pp_schedule, p.pp_virtual)
        split = split_layers(cfg.model, n_stages, p.pp_layers)
        stages = [s for s in range(n_stages) if stage_rank(s, p.pp, p.pp_schedule) == pp_rank]
        layers = sorted(lid for s in stages for lid in split[s])
        first, last = 0 in stages, n_stages - 1 in stages
    return activation_bytes(cfg.model, layers=layers, first=first, last=last, **_activation_layout(cfg, world))


def format_report(cfg: Config, world: int, results: list[TrainResult]) -> str:
    lines = [f"model-state bytes per rank, ZeRO-{cfg.parallel.zero} (measured | formula):"]
    for rank, res in enumerate(results):
        want = expected_state_bytes(cfg, world, rank)
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
    timeline = [a for res in results for a in res.timeline]
    if timeline:
        from fived.parallel.pipeline import stages_per_rank
        from fived.parallel.schedule_sim import bubble_of

        p, m = cfg.parallel.pp, cfg.train.microbatches
        stages = p * stages_per_rank(cfg.parallel.pp_schedule, cfg.parallel.pp_virtual)
        lines.append(f"pipeline bubble of {cfg.parallel.pp_schedule}, simulated from the executed actions with unit "
                     f"times: {bubble_of(timeline, stages):.4f} (GPipe/1F1B textbook (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.4f})")
    if any(res.activations for res in results):
        lines.append(f"activation bytes saved for backward per micro-batch ({cfg.train.activation_checkpointing} "
                     "checkpointing; measured | formula):")
        for rank, res in enumerate(results):
            want_act = expected_activations(cfg, world, rank)
            got_total, want_total = sum(res.activations.values()), sum(want_act.values())
            err = (got_total - want_total) / want_total if want_total else 0.0
            lines.append(f"  rank {rank} total: {got_total:,} | {want_total:,} ({err:+.2%})")
            if rank % (world // cfg.parallel.pp):  # parts listed for one rank per pipeline rank
                continue
            for name, got in res.activations.items():
                label = name if name in ("embedding", "head") else f"layer {name}"
                if name not in ("embedding", "head") and cfg.model.is_moe and int(name) >= cfg.model.n_dense_layers:
                    label += " (MoE, balanced routing)"
                lines.append(f"    {label}: {got:,} | {want_act.get(name, 0):,}")
    return "\n".join(lines)
