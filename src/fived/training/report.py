"""`fived train --report`: what the ledger measured next to what the formulas say it should be.

Model-state bytes per rank, N parameters of b bytes (b = 4 for float32 and bfloat16-autocast runs,
which keep float32 weights; 8 for float64), S = dp_shard, Adam keeps two states per parameter:

    stage   params   grads    optimizer      per parameter: float32 weights | train.dtype=bfloat16
    ZeRO-0  N b      N b      2 N b          16                   | 2 + 2 + 12
    ZeRO-1  N b      N b      2 N b / S      8 + 8/S              | 2 + 2 + 12/S
    ZeRO-2  N b      N b / S  2 N b / S      4 + 12/S             | 2 + 14/S
    ZeRO-3  N b / S  N b / S  2 N b / S      16/S                 | 16/S

train.dtype=bfloat16 keeps bf16 weights and gradients and, per element the optimizer updates, a
float32 master and two float32 moments (12 bytes, sharded like the optimizer); under ZeRO-3 FSDP2's
float32 sharded parameters are the masters (4 + 4 + 8 over S, gathered in bf16). The rule is
`fived.planner.memory.state_element_bytes`. Shards are padded to equal length, so a rank may hold
slightly less.

Communication per step: the planner's model of every collective (`fived.planner.communication`).
"""

from __future__ import annotations

from fived.config import Config
from fived.layout.activation_model import activation_bytes, layer_bytes
from fived.layout.layout import stages_per_rank
from fived.layout.spec import layout_specs
from fived.layout.stages import rank_chunks, rank_stages
from fived.model.transformer import build_model
from fived.parallel.expert import apply_expert_parallel
from fived.parallel.mesh import PRECISIONS, Layout, Mesh
from fived.parallel.tensor import TensorParallel
from fived.training.trainer import TrainResult


def expected_state_bytes(cfg: Config, world: int, rank: int = 0) -> dict[str, int]:
    """The table above for global rank `rank`, exactly (the planner's model-state formula: this
    rank's pipeline stages, its ZeRO slice or FSDP2 rows over S = dp_shard x cp; with expert
    parallelism its E/ep experts sharded over edp = dp*cp/ep by ZeRO-3 and kept whole by 0/1/2)."""
    from fived.planner.memory import state_bytes

    layout = Layout.from_config(cfg, world)
    where = layout.coordinates(rank)
    return state_bytes(
        cfg.model, layout, cfg.train.dtype, rank_chunks(cfg.model, layout, where["pp"]), where["shard"], where["edp"]
    )


def local_model(cfg: Config, world: int):
    """Rank 0's tensor/expert-parallel model on meta, split by the runtime's own code."""
    model = build_model(cfg.model)
    mesh = Mesh.from_config(cfg, world)
    if mesh.tp > 1:
        specs = layout_specs(cfg.model, mesh.layout)
        TensorParallel(model, None, mesh.layout.sp, mesh.tp, 0, specs, fold_experts=mesh.layout.folded).apply(model)
    if mesh.ep > 1:
        apply_expert_parallel([model], None, mesh.ep)
    return model


def expected_comm_bytes(cfg: Config, world: int, rank: int = 0) -> dict[str, int]:
    """Bytes per collective per mesh dimension of one step on global rank `rank`, keyed like the
    ledger ("dim/collective"): the planner's communication model (`fived.planner.communication`,
    which documents every term), so --report and the planner's step time price the same bytes."""
    from fived.planner.communication import ledger_bytes, step_collectives

    layout = Layout.from_config(cfg, world)
    where = layout.coordinates(rank)
    pp_rank, member = where["pp"], where["member"]
    collectives = step_collectives(
        cfg.model,
        layout,
        cfg.train.seq_len,
        cfg.train.global_batch,
        cfg.train.dtype,
        rank_chunks(cfg.model, layout, pp_rank),
        rank_stages(layout, pp_rank),
        member=member,
    )
    return ledger_bytes(collectives, layout)


def _activation_layout(cfg: Config, world: int) -> dict:
    """The layout arguments of `fived.layout.activation_model.activation_bytes` for this config."""
    t, p = cfg.train, cfg.parallel
    mesh = Mesh.from_config(cfg, world)
    return dict(
        micro_batch_seqs=t.global_batch // mesh.dp // t.microbatches,
        seq_len=t.seq_len,
        tp=mesh.tp,
        sp=p.sp,
        cp=mesh.cp,
        ep=mesh.ep,
        dtype_bytes=PRECISIONS[t.dtype].compute.itemsize,
        autocast=PRECISIONS[t.dtype].autocast,
        checkpointing=t.activation_checkpointing,
        ulysses=mesh.layout.ulysses,
        document_mask=cfg.data.document_mask,
        folded=mesh.layout.folded,
    )


def expected_activation_bytes(cfg: Config, world: int) -> int:
    """Bytes one dense transformer layer saves for backward per micro-batch on one rank (the
    formula of `fived.layout.activation_model`, which documents every term), for our architecture
    (RMSNorm, GQA, SwiGLU, SDPA keeping only its log-sum-exp; the Korthikanti et al. count redone).
    Per token, in elements, without checkpointing: each RMSNorm keeps its input, the normalised
    input and its output (3h, twice), plus 1/rms; attention keeps q and its output (2h), k and v
    (2 h_kv) and a log-sum-exp per head (a); SwiGLU keeps gate, up, silu(gate) and their product
    (4f). Per layer the RoPE tables (2 s head_dim). Tensor parallelism divides q, attention output,
    the heads and the MLP by T; sequence parallelism also divides the norms' part; kv heads are
    divided while T <= n_kv_heads and one head is kept otherwise; B counts this rank's tokens
    (seq_len / cp of each sequence; ring attention keeps what SDPA keeps):
        B*e*(6h/T_sp + 2/T_sp + (2h + 4f + a)/T + 2 h_kv_local) + 2*s*head_dim*e"""
    return layer_bytes(cfg.model, moe=False, **_activation_layout(cfg, world))


def expected_activations(cfg: Config, world: int, rank: int = 0) -> dict[str, int]:
    """{part: bytes saved for backward per micro-batch} on global rank `rank`: its layers (all
    of them, or its pipeline stages'), "embedding" and "head" where it holds them."""
    layout = Layout.from_config(cfg, world)
    chunks = rank_chunks(cfg.model, layout, layout.coordinates(rank)["pp"])
    layers = sorted(lid for c in chunks for lid in c[0])
    first, last = any(c[1] for c in chunks), any(c[2] for c in chunks)
    return activation_bytes(cfg.model, layers=layers, first=first, last=last, **_activation_layout(cfg, world))


def report_figures(cfg: Config, world: int, results: list[TrainResult]) -> dict:
    """The measured-vs-formula tables of `--report` (model-state bytes per rank, rank 0's collectives
    per mesh dimension), the pipeline's executed actions and the MoE expert load per layer: what
    `format_report` prints and what `fived train` writes to the run directory's run.json."""
    state = [
        {
            "rank": rank,
            "measured": {k: res.memory.get(k, 0) for k in ("params", "grads", "optimizer")},
            "predicted": expected_state_bytes(cfg, world, rank),
        }
        for rank, res in enumerate(results)
    ]
    want_comm, comm = expected_comm_bytes(cfg, world), results[0].comm
    comm_rows = [
        {
            "key": key,
            "bytes": comm.get(key, {}).get("bytes", 0),
            "calls": comm.get(key, {}).get("calls", 0),
            "predicted": want_comm.get(key, 0),
        }
        for key in sorted(set(comm) | set(want_comm))
    ]
    actions = [a for res in results for a in res.timeline]
    t0 = min((a.start for a in actions), default=0.0)  # seconds from the step's first action
    timeline = [[a.rank, a.kind, a.stage, a.microbatch, a.start - t0, a.end - a.start] for a in actions]
    loads: dict[str, list[float]] = {}
    for res in results:
        loads.update(res.expert_load)
    return {
        "state": state,
        "comm": comm_rows,
        "timeline": timeline,
        "expert_load": dict(sorted(loads.items(), key=lambda kv: block_order(kv[0]))),
    }


def block_order(name: str) -> tuple[str, int]:
    """A block's place among a model's blocks: the layers by index ("12"), then the multi-token
    prediction blocks ("mtp.0", whose MoE has an expert load too) by theirs."""
    head, _, index = name.rpartition(".")
    return head, int(index)


def write_run_json(
    cfg: Config, world: int, results: list[TrainResult], breakdowns: list[list[dict]] | None = None
) -> None:
    """run.json in the run directory (`fived report` and `fived diagnose` read it): the report's
    figures, the layout, the config, and the measured step breakdown of every rank beside the
    planner's (`breakdowns`: each rank's per-step breakdowns, where `results` holds only some ranks)."""
    import json
    from pathlib import Path

    from fived.files import write_file
    from fived.training.breakdown import run_breakdown
    from fived.write_errors import writing

    figures = report_figures(cfg, world, results)
    figures["bubble_line"] = _bubble_line(cfg, results)
    figures["layout"] = Layout.from_config(cfg, world).to_dict()
    figures["world"] = world
    figures["config"] = cfg.to_dict()
    per_rank = breakdowns if breakdowns is not None else [r.breakdowns for r in results]
    if any(per_rank):
        figures["breakdown"] = run_breakdown(cfg, world, per_rank)
    with writing(Path(cfg.train.output_dir) / "run.json"):
        write_file(cfg.train.output_dir, "run.json", json.dumps(figures))


def _bubble_line(cfg: Config, results: list[TrainResult]) -> str:
    timeline = [a for res in results for a in res.timeline]
    if not timeline:
        return ""
    from fived.layout.schedule_sim import bubble_of

    p, m = cfg.parallel.pp, cfg.train.microbatches
    stages = p * stages_per_rank(cfg.parallel.pp_schedule, cfg.parallel.pp_virtual)
    return (
        f"pipeline bubble of {cfg.parallel.pp_schedule}, simulated from the executed actions with unit "
        f"times: {bubble_of(timeline, stages):.4f} (GPipe/1F1B textbook (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.4f})"
    )


def format_report(cfg: Config, world: int, results: list[TrainResult]) -> str:
    figures = report_figures(cfg, world, results)
    lines = [f"model-state bytes per rank, ZeRO-{cfg.parallel.zero} (measured | formula):"]
    for row in figures["state"]:
        cells = [f"{k} {row['measured'][k]:,} | {row['predicted'][k]:,}" for k in ("params", "grads", "optimizer")]
        lines.append(f"  rank {row['rank']}: " + "; ".join(cells))
    lines.append("communication per step on rank 0, by mesh dimension (measured bytes, calls | formula bytes):")
    for row in figures["comm"]:
        lines.append(f"  {row['key']}: {row['bytes']:,} B in {row['calls']} call(s) | {row['predicted']:,} B")
    if not figures["comm"]:
        lines.append("  (none: a single rank)")
    if figures["timeline"]:
        lines.append(_bubble_line(cfg, results))
    if any(res.activations for res in results):
        lines.append(
            f"activation bytes saved for backward per micro-batch ({cfg.train.activation_checkpointing} "
            "checkpointing; measured | formula):"
        )
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
