"""What `fived plan` prints: the ranking, the winner's time and memory, and why the runners-up lose.

Runners-up are not the next entries of the ranking (those differ from the winner in a detail); they
are, for each decision (tp, pp, cp, ep, ZeRO stage, HSDP, SP, schedule, micro-batch, checkpointing),
the best plan that decides it differently — and the line says which parts of its step grew and
every decision it makes differently (a best alternative often changes two: tp down means cp or dp
up), or, when no plan with that value fits, how much memory the least hungry one needed.
"""

from __future__ import annotations

from fived.config import ModelConfig
from fived.layout.flops import matmul_params_per_token
from fived.planner.basis import basis
from fived.planner.runtimes import FIVED, Runtime
from fived.planner.search import DECISIONS, Plan, Search, cp_modes, evaluate, run_flags, train_command
from fived.planner.timing import Cluster

PARTS = {
    "compute": "compute",
    "bubble": "pipeline bubble",
    "tp": "tensor-parallel communication",
    "cp": "context-parallel communication",
    "ep": "expert all-to-all",
    "pp": "pipeline send/recv",
    "dp": "gradient reduction (exposed)",
    "optimizer": "optimizer step",
    "overhead": "host overhead",
}


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _time_parts(plan: Plan) -> str:
    t = plan.time
    return " + ".join(f"{PARTS[k]} {getattr(t, k):.3g}" for k in PARTS if getattr(t, k) > 0)


def _memory_parts(plan: Plan) -> str:
    m = plan.memory
    return ", ".join(
        f"{k} {_gib(getattr(m, k))}" for k in ("params", "grads", "optimizer", "activations", "buffers", "reserve")
    )


def _why_slower(plan: Plan, winner: Plan) -> str:
    deltas = sorted(((getattr(plan.time, k) - getattr(winner.time, k), k) for k in PARTS), reverse=True)
    grew = [f"{PARTS[k]} +{d:.3g} s" for d, k in deltas[:2] if d > 1e-9 * winner.time.total]
    return ", ".join(grew) or "equal time (a tie broken by order)"


def _link_notes(plan: Plan, cluster: Cluster) -> list[str]:
    L, g = plan.layout, cluster.gpus_per_node
    notes = []
    if L.tp > 1:
        notes.append(f"tp{L.tp} " + ("inside a node (NVLink)" if L.tp <= g else "across nodes (network)"))
    if L.cp > 1:
        notes.append(f"cp{L.cp} " + ("inside a node" if L.tp * L.cp <= g else "across nodes"))
    if L.ep > 1:
        notes.append(f"ep{L.ep} " + ("inside a node" if L.expert_tp * L.ep <= g else "across nodes"))
    if L.dp_cp > 1:
        notes.append("gradients reduced " + ("inside a node" if L.tp * L.cp * L.dp <= g else "across nodes"))
    return notes


def _cp_mode_name(layout) -> str:
    return (
        f"hybrid (Ulysses groups of {layout.cp_ulysses}, a ring across)"
        if layout.cp_mode == "hybrid"
        else layout.cp_mode
    )


def _cp_mode_note(
    winner: Plan,
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str,
    runtime: Runtime,
    headroom_gib: float,
) -> list[str]:
    """Why the winner's context parallelism is a ring, Ulysses or hybrid: its exposed cp time against
    the same layout's in every other mode the heads allow."""
    L = winner.layout
    if L.cp == 1:
        return []
    lines = [
        f"  cp mode: {_cp_mode_name(L)}, {winner.time.cp:.3g} s of cp communication exposed (the ring's "
        "hops hide behind the attention blocks; Ulysses' all-to-alls of q, k, v and the output do not)"
    ]
    for mode, u in cp_modes(model, L.tp, L.cp):
        other = L.with_(cp_mode=mode, cp_ulysses=u)
        if other == L:
            continue
        plan = evaluate(model, other, cluster, seq_len, global_batch, dtype, runtime, headroom_gib)
        if plan is not None:
            lines.append(
                f"    {_cp_mode_name(other)}: {plan.time.cp:.3g} s exposed, step "
                f"{(plan.time.total / winner.time.total - 1) * 100:+.1f}%" + ("" if plan.fits else ", does not fit")
            )
    heads = model.n_heads // L.tp
    if len(cp_modes(model, L.tp, L.cp)) == 1:
        lines.append(f"    Ulysses cannot split the {heads} heads of a tp rank over any group of these {L.cp} ranks")
    return lines


def runners_up(search: Search) -> list[tuple[str, list, Plan | None]]:
    """Per decision: (decision, [value], the best plan deciding it otherwise), then
    (decision, [values], None) for the values no fitting plan has."""
    winner = search.plans[0]
    best: dict = {}
    for plan in search.plans[1:]:  # fastest first: the first plan seen per decision is its best
        for d in DECISIONS:
            value = getattr(plan.layout, d)
            if value != getattr(winner.layout, d) and d not in best:
                best[d] = plan
    out = [(d, [getattr(p.layout, d)], p) for d, p in best.items()]
    seen = {(d, getattr(p.layout, d)) for p in search.plans for d in DECISIONS}
    for d in DECISIONS:
        missing = sorted((v for (dd, v) in search.smallest if dd == d and (d, v) not in seen), key=str)
        if missing:
            out.append((d, missing, None))
    return out


def _differs(plan: Plan, winner: Plan) -> str:
    return ", ".join(
        f"{d} {getattr(winner.layout, d)}->{getattr(plan.layout, d)}"
        for d in DECISIONS
        if getattr(plan.layout, d) != getattr(winner.layout, d)
    )


def report(
    search: Search,
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    top: int,
    model_arg: str = "",
    dtype: str = "bfloat16",
    runtime: Runtime = FIVED,
    headroom_gib: float = 0.0,
) -> str:
    """The text `fived plan` prints. `model_arg`: how `fived train` names the model (--model NAME or
    --config FILE)."""
    hw = cluster.hardware
    lines = [
        f"fived plan: {model.name} ({matmul_params_per_token(model) / 1e9:.1f}B matmul params per token), "
        f"{cluster.gpus} x {hw.name} ({cluster.gpus_per_node} per node, {hw.memory_gib:.4g} GiB each), "
        f"seq {seq_len}, global batch {global_batch} sequences ({global_batch * seq_len:,} tokens), "
        f"runtime {runtime.name}"
        + (" with FP8 GEMMs" if runtime.fp8 else "")
        + (", blocks uncompiled" if runtime.is_fived and not runtime.fused else ""),
        f"{search.considered} valid layouts considered, {search.fitting} fit in memory"
        + (f" ({headroom_gib:g} GiB of each GPU left free)" if headroom_gib else ""),
    ]
    if not search.considered:
        lines.append(
            f"no valid layout: {cluster.gpus} GPUs cannot be split into dp x tp x pp x cp for this model "
            f"(tp must divide {model.n_heads} heads, dp the {global_batch} sequences, pp the "
            f"{model.n_layers} layers); try a GPU count that is a multiple of {cluster.gpus_per_node}"
        )
        return "\n".join(lines)
    if not search.plans:
        need = min(search.smallest.values())
        lines.append(
            f"no layout fits: the least memory any needs is {_gib(need)} GiB per GPU of {hw.memory_gib:g}; "
            f"use more GPUs, GPUs with more memory, or a shorter sequence / smaller global batch"
        )
        return "\n".join(lines)
    lines.append(f"{'#':>3}  {'layout':<58} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'GiB':>6}")
    for i, p in enumerate(search.plans[:top], 1):
        lines.append(
            f"{i:>3}  {p.layout.describe():<58} {p.time.total:>8.3g} {p.time.tokens_per_s_per_gpu:>10.1f} "
            f"{p.time.mfu:>6.1%} {_gib(p.memory.total):>6}"
        )
    w = search.plans[0]
    run = (
        f"{train_command(model_arg or '--model ' + model.name, seq_len, dtype)} "
        f"{run_flags(w.layout, global_batch, runtime)}"
        if w.layout.runnable and runtime.is_fived
        else f"planned for the {runtime.name} runtime; fived's own price of it: --runtime fived"
        if w.layout.runnable
        else f"not runnable by fived yet (planned for the {runtime.name} runtime)"
    )
    lines += [
        f"winner: {w.layout.describe()}",
        f"  run it: {run}",
        f"  step {w.time.total:.3g} s = {_time_parts(w)}",
        f"  memory {_gib(w.memory.total)} of {hw.memory_gib:g} GiB = {_memory_parts(w)}",
        "  links: " + ("; ".join(_link_notes(w, cluster)) or "single GPU"),
        *_cp_mode_note(w, model, cluster, seq_len, global_batch, dtype, runtime, headroom_gib),
        "  basis: " + "\n         ".join(basis(model, cluster, runtime, w.layout, seq_len)),
        "runners-up (the best plan deciding one thing differently):",
    ]
    for d, values, other in runners_up(search):
        if other is None:
            need = min(search.smallest[(d, v)] for v in values)
            room = f"{hw.memory_gib - headroom_gib:g} GiB" + (
                f": {hw.memory_gib:g} less {headroom_gib:g} of headroom" if headroom_gib else ""
            )
            lines.append(
                f"  {d}={'/'.join(map(str, values))}: nothing fits (least memory needed {_gib(need)} GiB > {room})"
            )
        else:
            slower = (other.time.total / w.time.total - 1) * 100
            lines.append(
                f"  {d}={values[0]}: {other.layout.describe()} is {slower:.1f}% slower: {_why_slower(other, w)} "
                f"(differs in {_differs(other, w)})"
            )
    return "\n".join(lines)


def to_json(
    search: Search,
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    top: int,
    runtime: Runtime = FIVED,
    headroom_gib: float = 0.0,
) -> dict:
    return {
        "model": model.name,
        "gpus": cluster.gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "gpu": cluster.hardware.name,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "runtime": runtime.name,
        "fp8": runtime.fp8,
        "memory_headroom_gib": headroom_gib,
        "basis": basis(model, cluster, runtime, search.plans[0].layout, seq_len) if search.plans else [],
        "considered": search.considered,
        "fitting": search.fitting,
        "plans": [p.to_dict(global_batch, runtime) for p in search.plans[:top]],
        "runners_up": [
            {
                "decision": d,
                "values": vs,
                "fits": p is not None,
                **(
                    {
                        "plan": p.to_dict(global_batch, runtime),
                        "slower_pct": (p.time.total / search.plans[0].time.total - 1) * 100,
                    }
                    if p is not None
                    else {"least_memory_gib": min(search.smallest[(d, v)] for v in vs) / 2**30}
                ),
            }
            for d, vs, p in (runners_up(search) if search.plans else [])
        ],
    }
