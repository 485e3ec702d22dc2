"""`fived explore --serve`: the serving planner's figures for every layout the page's toggles reach, as
one JSON document the page (`fived.tools.pages`, kind "serve") only looks values up in.

The toggles (tp, pp, ep, weights, requests in flight) span the cluster's serving layouts: dp is what
the GPU count leaves (gpus / (tp*pp)). Each combination is priced by `fived.planner.serve.evaluate`
at that concurrency (closed loop) — memory per GPU (weights, KV cache, activations, reserve), the
sequences that fit, prefill and decode times, mean and p99 latencies, throughput, the vLLM command —
or refused with fived's own one-line reason (`serve.serving_refusal`). Beside them, the ranking of
`fived plan --serve` for the workload and the training layout `fived plan` picks for the cluster.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from fived.config import ModelConfig
from fived.planner.serve import Workload, evaluate, plan_serving, serving_refusal
from fived.planner.serve_explain import model_path, training_view, vllm_command, vllm_mismatch, why_they_differ
from fived.planner.serve_model import ServeLayout
from fived.planner.timing import Cluster

CONCURRENCY = [1, 8, 32, 128, 512]  # requests in flight over the cluster
MEMORY_PARTS = ("weights", "kv_cache", "activations", "reserve", "total")
DENSE_EP = [1, 2]  # a dense model's ep toggle: 2 shows the runtime's refusal


def options(m: ModelConfig, cluster: Cluster, weights: tuple[str, ...]) -> dict:
    powers = [d for d in (1, 2, 4, 8, 16) if d <= cluster.gpus and cluster.gpus % d == 0]
    eps = [e for e in powers if m.n_experts % e == 0] if m.is_moe else DENSE_EP
    dtypes = [w for w in weights if w == "bf16" or cluster.hardware.fp8_tflops > 0]
    return {
        "tp": [d for d in powers if d <= cluster.gpus_per_node],
        "pp": powers,
        "ep": eps,
        "weights": dtypes,
        "concurrency": CONCURRENCY,
    }


def entry_key(values: dict) -> str:
    """The page's lookup key: the toggles' values in options order (what the page's script builds)."""
    return "|".join(str(values[k]) for k in ("tp", "pp", "ep", "weights", "concurrency"))


def price(m: ModelConfig, layout: ServeLayout, cluster: Cluster, w: Workload, headroom_gib: float, path: str) -> dict:
    """The page's entry for one layout at one concurrency: {"error": reason} or the planner's figures."""
    reason = serving_refusal(m, layout)
    if reason is not None:
        return {"error": str(reason)}
    plan = evaluate(m, layout, cluster, w, headroom_gib)
    gib = plan.memory.gib()
    return {
        "memory": [gib[k] for k in MEMORY_PARTS],
        "fits": plan.fit >= 1,
        "fit": plan.fit,
        "describe": layout.describe(),
        "dp": layout.dp,
        "batch": plan.at.batch if plan.at.stable else 0,
        "times_ms": [
            _finite(t * 1e3)
            for t in (
                plan.prefill.total,
                plan.step_s,
                plan.at.ttft_s,
                plan.at.p99_ttft_s,
                plan.at.tpot_s,
                plan.at.p99_tpot_s,
            )
        ],
        "throughput": plan.throughput,
        "meets": plan.meets,
        "reasons": plan.reasons,
        "vllm": (vllm_command(plan, w, path, m) or vllm_mismatch(m, layout)) if plan.fit else "",
    }


def _finite(x: float) -> float | None:
    """JSON has no infinity (a saturated replica's latencies): null, which the page shows as saturated."""
    return x if math.isfinite(x) else None


def serve_explore_data(
    m: ModelConfig,
    cluster: Cluster,
    w: Workload,
    weights: tuple[str, ...],
    source: str,
    training_shape: tuple[int, int],
    headroom_gib: float = 0.0,
) -> dict:
    """Everything the serving page shows (see the module docstring)."""
    opts = options(m, cluster, weights)
    path = model_path(source, m.name)[0]
    entries: dict = {}
    errors: list[str] = []
    for tp, pp, ep, dtype, c in itertools.product(*opts.values()):
        key = entry_key({"tp": tp, "pp": pp, "ep": ep, "weights": dtype, "concurrency": c})
        if cluster.gpus % (tp * pp):
            continue
        entry = price(
            m,
            ServeLayout(tp=tp, pp=pp, dp=cluster.gpus // (tp * pp), ep=ep, weights=dtype),
            cluster,
            replace(w, rate=0.0, concurrency=c),
            headroom_gib,
            path,
        )
        if "error" in entry:  # reasons repeat: stored once, referenced by index
            if entry["error"] not in errors:
                errors.append(entry["error"])
            entries[key] = errors.index(entry["error"])
            continue
        entries[key] = entry
    ranked = plan_serving(m, cluster, w, tuple(opts["weights"]), headroom_gib)
    train = training_view(m, cluster, *training_shape, headroom_gib)
    chosen = ranked[0].layout if ranked else ServeLayout()
    hw = cluster.hardware
    return {
        "model": m.name,
        "gpus": cluster.gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "gpu": hw.name,
        "device_gib": hw.memory_gib,
        "capacity_gib": hw.memory_gib - headroom_gib,
        "prompt_len": w.prompt_len,
        "output_len": w.output_len,
        "kv_dtype": w.kv_dtype,
        "options": opts,
        "memory_parts": MEMORY_PARTS,
        "errors": errors,
        "entries": entries,
        "chosen": {
            "tp": chosen.tp,
            "pp": chosen.pp,
            "ep": chosen.ep,
            "weights": chosen.weights,
            "describe": chosen.describe(),
        },
        "training": _training_lines(train),
        "why": why_they_differ(ranked[0], train, m, w) if ranked else [],
    }


def _training_lines(train) -> list[str]:
    plan = train.plan or train.plan_there
    lines = []
    if train.plan is None:
        lines.append(
            f"no training layout fits this cluster: the least memory any needs is {train.least_gib:.1f} GiB per GPU"
        )
    if plan is not None:
        where = "this cluster" if train.plan is not None else f"{train.fits_at} GPUs"
        lines.append(
            f"fived plan picks on {where}: {plan.layout.describe()}, {plan.memory.total / 2**30:.1f} GiB per "
            f"GPU, step {plan.time.total:.3g} s, MFU {plan.time.mfu:.1%} (seq {train.seq_len}, "
            f"{train.global_batch * train.seq_len:,} tokens per step)"
        )
    return lines
