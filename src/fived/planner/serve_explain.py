"""What `fived plan --serve` prints: the ranking, the chosen layout's memory and time per GPU, its p99
latencies under the workload, the command that serves it with vLLM, and next to it the training layout
`fived plan` picks for the same model and cluster, with why the two differ."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fived.config import ModelConfig
from fived.layout.flops import matmul_params_per_token
from fived.layout.spec import cached_positions, kv_cache_width, kv_width
from fived.planner.search import Plan
from fived.planner.serve import ServePlan, Workload, gpus_needed, in_flight
from fived.planner.serve_model import ForwardTime
from fived.planner.timing import Cluster

TRAINING_GROWTH_LIMIT = 64  # look for the smallest training cluster up to 64x the serving one


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _ms(s: float) -> str:
    return "inf" if s == float("inf") else f"{s * 1e3:.1f}"


def _parts(t: ForwardTime) -> str:
    names = {
        "compute": "compute/HBM",
        "tp": "tp all-reduce",
        "ep": "expert all-to-all",
        "pp": "pipeline send",
        "host": "host dispatch",
    }
    return " + ".join(
        f"{names[k]} {getattr(t, k) * 1e3:.2f}" + (f" ({t.calls[k]} calls)" if k in t.calls else "")
        for k in names
        if getattr(t, k) > 0
    )


def model_path(source: str, name: str) -> tuple[str, str]:
    """(the path vLLM loads, what to run first): a Hugging Face directory as is, a fived run exported."""
    path = Path(source)
    if (path / "config.json").is_file():
        return source, ""
    if path.is_dir():
        out = f"{source.rstrip('/')}-hf"
        return out, f"fived export {source} --output {out}"
    return (
        f"path/to/{name}-hf",
        f"(the model in Hugging Face format: `fived export RUN --output path/to/{name}-hf` of a fived run)",
    )


def vllm_mismatch(m: ModelConfig, layout) -> str:
    """Why vLLM cannot run `layout` as it is priced ("" when it can): its --enable-expert-parallel
    spreads whole experts over an engine's tp x dp GPUs, where fived's ep over replicas cuts each of a
    replica's E/ep experts over tp."""
    if layout.ep > 1 and layout.tp > 1:
        return (
            f"vLLM's --enable-expert-parallel places whole experts on its tp x dp = {layout.tp * layout.ep} GPUs, "
            f"while this layout cuts each of a replica's {m.n_experts // layout.ep} experts over tp{layout.tp} "
            f"(fived's ep over replicas): no vLLM command runs it as priced"
        )
    return ""


def vllm_command(plan: ServePlan, w: Workload, path: str, m: ModelConfig) -> str:
    """The command that serves the layout with vLLM as priced ("" when vLLM cannot: `vllm_mismatch`;
    or when the layout holds no sequence: nothing to serve with). One engine per ep group (dp/ep such
    engines behind a load balancer); an MoE model without ep runs dp separate engines, since vLLM's
    --data-parallel-size would cut its experts over tp x dp GPUs."""
    L = plan.layout
    if vllm_mismatch(m, L) or not plan.fit:
        return ""
    words = [f"vllm serve {path}", f"--tensor-parallel-size {L.tp}"]
    if L.pp > 1:
        words.append(f"--pipeline-parallel-size {L.pp}")
    engine_dp = L.ep if m.is_moe else L.dp
    if engine_dp > 1:
        words.append(f"--data-parallel-size {engine_dp}")
    if L.ep > 1:
        words.append("--enable-expert-parallel")
    if L.weights == "fp8":
        words.append("--quantization fp8")
    if w.kv_dtype == "fp8":
        words.append("--kv-cache-dtype fp8")
    words += [f"--max-model-len {w.positions}", f"--max-num-seqs {max(1, plan.fit)}"]
    command = " ".join(words)
    if L.dp > engine_dp:
        command += f"    # x {L.dp // engine_dp} engines behind a load balancer"
    return command


@dataclass
class TrainingView:
    """What `fived plan` picks for training the model on the cluster (or the smallest that fits)."""

    seq_len: int
    global_batch: int
    plan: Plan | None  # None when nothing fits this cluster
    least_gib: float  # the least memory any training layout needed here (when none fits)
    fits_at: int  # GPUs at which training first fits (0: this cluster, or not within the limit)
    plan_there: Plan | None


def training_view(
    m: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, headroom_gib: float
) -> TrainingView:
    from fived.planner.runtimes import PLANNED_RUNTIMES
    from fived.planner.search import plan

    runtime = PLANNED_RUNTIMES["fived"]
    search = plan(m, cluster, seq_len, global_batch, "bfloat16", runtime, headroom_gib)
    if search.plans:
        return TrainingView(seq_len, global_batch, search.plans[0], 0.0, 0, None)
    least = min(search.smallest.values()) / 2**30 if search.smallest else float("inf")
    gpus = cluster.gpus
    while gpus < cluster.gpus * TRAINING_GROWTH_LIMIT:
        gpus *= 2
        there = plan(
            m,
            Cluster(cluster.hardware, gpus, cluster.gpus_per_node),
            seq_len,
            global_batch,
            "bfloat16",
            runtime,
            headroom_gib,
        )
        if there.plans:
            return TrainingView(seq_len, global_batch, None, least, gpus, there.plans[0])
    return TrainingView(seq_len, global_batch, None, least, 0, None)


def why_they_differ(serve: ServePlan, train: TrainingView, m: ModelConfig, w: Workload) -> list[str]:
    """Computed reasons: what each holds per GPU, and what each layout optimises."""
    L = serve.layout
    lines = [
        f"serving holds {_gib(serve.memory.weights)} GiB of {L.weights} weights per GPU and a KV cache "
        f"({_gib(serve.memory.kv_cache)} GiB at its operating batch, up to {serve.fit} sequences of "
        f"{w.positions} positions per replica); no gradients, no optimizer state, no activations kept for backward"
    ]
    plan = train.plan or train.plan_there
    if plan is not None:
        mem = plan.memory
        state = mem.params + mem.grads + mem.optimizer
        lines.append(
            f"training ({plan.layout.describe()}) holds {_gib(state)} GiB of model state per GPU (bf16 "
            f"weights and gradients, float32 masters and AdamW moments) and {_gib(mem.activations)} GiB of "
            f"activations saved for backward"
        )
    if train.plan is None:
        where = f"; `fived plan` first fits it on {train.fits_at} GPUs" if train.fits_at else ""
        lines.append(
            f"training does not fit on {L.gpus} GPU{'s' if L.gpus > 1 else ''}: the least memory any training layout needs is "
            f"{train.least_gib:.1f} GiB per GPU{where}"
        )
    lines.append(_bound(serve, w))
    lines.append(
        _spread(L)
        + (
            f"; training's step spends {plan.time.compute / plan.time.total:.1%} of its "
            f"{plan.time.total:.3g} s computing"
            if plan is not None
            else ""
        )
    )
    return lines


def _bound(serve: ServePlan, w: Workload) -> str:
    """What bounds the decode step and the prefill: the longer of the GEMMs and the reads (weights, KV
    cache) the model priced."""
    d, p = serve.decode, serve.prefill
    batch = serve.at.batch if serve.at.stable else max(serve.fit, 1)
    sequences = batch / in_flight(serve.layout, batch)
    line = (
        f"a decode forward of {sequences:.0f} sequence{'s' if round(sequences) != 1 else ''} brings one token "
        f"each: reading the weights and KV "
        f"cache (each GPU its share) takes {_ms(d.read)} ms, its GEMMs {_ms(d.gemm)} ms: "
    )
    line += "bound by HBM bandwidth" if d.read > d.gemm else "compute-bound (the batch amortises the reads)"
    kind = "compute-bound" if p.gemm >= p.read else "bound by HBM bandwidth"
    return line + f"; a prefill of {w.prompt_len} tokens is {kind} (GEMMs {_ms(p.gemm)} ms, reads {_ms(p.read)} ms)"


def _spread(L) -> str:
    """What the serving layout does with its GPUs, each dimension only when it is used."""
    parts = []
    if L.tp > 1:
        parts.append(f"splits every layer over tp{L.tp} inside a node, dividing what each GPU reads per token")
    if L.pp > 1:
        parts.append(f"splits the layers over pp{L.pp} stages with {L.pp} micro-batches in flight")
    if L.ep > 1:
        parts.append(f"spreads the routed experts over ep{L.ep} replicas")
    if L.dp > 1:
        parts.append(f"replicates (dp{L.dp}) for throughput")
    return "serving " + (", ".join(parts) if parts else "runs the whole model on each GPU")


def report(
    plans: list[ServePlan],
    m: ModelConfig,
    cluster: Cluster,
    w: Workload,
    top: int,
    source: str,
    train: TrainingView | None,
) -> str:
    hw = cluster.hardware
    load = (
        f"{w.rate:g} requests/s (Poisson)"
        if w.rate
        else f"{w.concurrency} requests in flight"
        if w.concurrency
        else "the most the targets allow"
    )
    targets = ", ".join(
        t
        for t in (
            f"p99 TTFT <= {w.ttft_s * 1e3:g} ms" if w.ttft_s != float("inf") else "",
            f"p99 TPOT <= {w.tpot_s * 1e3:g} ms" if w.tpot_s != float("inf") else "",
        )
        if t
    )
    lines = [
        f"fived plan --serve: {m.name} ({matmul_params_per_token(m) / 1e9:.1f}B matmul params per token) on "
        f"{cluster.gpus} x {hw.name} ({cluster.gpus_per_node} per node, {hw.memory_gib:.4g} GiB each)",
        f"workload: prompts of {w.prompt_len} tokens, {w.output_len} output tokens, {load}"
        + (f"; targets {targets}" if targets else "")
        + f"; KV cache in {w.kv_dtype}",
        _queueing(w),
    ]
    if not plans:
        return "\n".join(
            lines + [f"no serving layout: {cluster.gpus} GPUs cannot be split into tp x pp x dp for this model"]
        )
    lines.append(
        f"{'#':>3}  {'layout':<22} {'GiB/GPU':>8} {'seqs/replica':>12} {'prefill ms':>10} {'step ms':>8} "
        f"{'p99 TTFT':>9} {'p99 TPOT':>9} {'tok/s' if w.concurrency else 'goodput':>9}  meets"
    )
    for i, p in enumerate(plans[:top], 1):
        score = p.throughput if w.concurrency else p.goodput
        lines.append(
            f"{i:>3}  {p.layout.describe():<22} {_gib(p.memory.total):>8} {p.fit:>12} {_ms(p.prefill.total):>10} "
            f"{_ms(p.step_s):>8} {_ms(p.at.p99_ttft_s):>9} {_ms(p.at.p99_tpot_s):>9} {score:>9.0f}  "
            + ("yes" if p.meets else "no: " + "; ".join(p.reasons))
        )
    best = plans[0]
    lines += _chosen(best, m, w, source)
    if not vllm_command(best, w, "", m):
        ranked = next(((i, p) for i, p in enumerate(plans, 1) if vllm_command(p, w, "", m)), None)
        if ranked is not None:
            lines.append(
                f"  the best layout vLLM runs as priced: #{ranked[0]} {ranked[1].layout.describe()}: "
                + vllm_command(ranked[1], w, model_path(source, m.name)[0], m)
            )
    if train is not None:
        lines += _training(train, m, cluster)
        lines.append("why they differ:")
        lines += [f"  - {reason}" for reason in why_they_differ(best, train, m, w)]
    lines.append(
        "basis: forward times from the training planner's fitted GEMM efficiency and link shares, HBM at "
        "its assumed share, nothing fitted on serving; how far they are from published serving benchmarks: "
        "`fived plan --serve --validate tests/data/published_serving.csv` (each row and the median error)"
    )
    return "\n".join(lines)


def _cached(m: ModelConfig, tp: int, dtype: str) -> str:
    """What a GPU caches per token and layer, in words."""
    if m.is_mla:
        return f"a kv latent of {m.kv_lora_rank} and a rope key of {m.qk_rope_head_dim} in {dtype}"
    return f"{kv_width(m, tp) // m.head_dim} kv heads of {m.head_dim} in {dtype}, keys and values"


def _rolling(m: ModelConfig, positions: int) -> str:
    """What a windowed layer caches of a sequence, when its window is shorter (a rolling cache)."""
    windowed = sum(1 for lid in range(m.n_layers) if m.layer_window(lid))
    kept = cached_positions(m.sliding_window, positions)
    return f" ({windowed} windowed layers cache their last {kept})" if windowed and kept < positions else ""


def _chosen(p: ServePlan, m: ModelConfig, w: Workload, source: str) -> list[str]:
    L, mem = p.layout, p.memory
    per_token = kv_cache_width(m, L.tp) * w.kv_bytes
    path, first = model_path(source, m.name)
    out = [
        f"chosen: {L.describe()}" + _shortfall(p, w),
        f"  per GPU: weights {_gib(mem.weights)} + KV cache {_gib(mem.kv_cache)} + activations {_gib(mem.activations)}"
        f" + reserve {_gib(mem.reserve)} = {_gib(mem.total)} GiB",
        f"  KV cache: {per_token} bytes per token and layer on a GPU ({_cached(m, L.tp, w.kv_dtype)}); "
        f"{p.fit} sequences of {w.positions} positions{_rolling(m, w.positions)} fit per replica "
        f"({p.fit * L.dp} in all)",
        f"  prefill of one prompt: {_ms(p.prefill.total)} ms = {_parts(p.prefill)}",
        _decode_line(p),
    ]
    if p.at.stable:
        out.append(
            f"  at {p.at.rate * L.dp:.2f} requests/s: mean TPOT {_ms(p.at.tpot_s)} ms, p99 TPOT {_ms(p.at.p99_tpot_s)} "
            f"ms, p99 TTFT {_ms(p.at.p99_ttft_s)} ms"
        )
    within = " within the targets" if w.has_targets else ""
    out.append(
        f"  the most it sustains{within}: {p.goodput:.0f} output tokens/s ({p.goodput / w.output_len:.2f} requests/s)"
    )
    needed = gpus_needed(p, w)
    if needed:
        out.append(f"  GPUs this layout needs for {w.rate:g} requests/s{within}: {needed}")
    command = vllm_command(p, w, path, m)
    if not p.fit:
        out.append(f"  serve it: not as priced: no layout priced holds one sequence; {_more_room(p, w)}")
    else:
        out.append(f"  serve it: {command}" if command else f"  serve it: {vllm_mismatch(m, L)}")
    if first and command:
        out.append(f"    first: {first}")
    return out


def _queueing(w: Workload) -> str:
    """How the workload's requests queue (`fived.planner.serve`'s model): open loop, or closed with
    --concurrency."""
    batching = "queueing: continuous batching with prefill priority, pp batches in flight through a pipeline; "
    if w.concurrency:
        return batching + (
            f"closed loop: {w.concurrency} requests in flight, each sent when the previous ends; the sequences "
            "the KV cache holds decode together, the rest wait for a slot; the replica never idle (its prefills "
            "and decode steps fill its time), latencies the open loop's at the rate this sustains"
        )
    return batching + (
        "M/D/1 prefill queue (p99 wait: exponential tail, Pollaczek-Khinchine mean); decode batch by Little's "
        "law; TPOT slowed by the prefills of arrivals (Poisson count, its 99th percentile for p99)"
    )


def _more_room(p: ServePlan, w: Workload) -> str:
    """The way out when the closest layout holds no sequence: more GPUs (its weights split further),
    fp8 weights, or a shorter sequence."""
    ways = [f"more GPUs (or a larger --tp/--pp) to split its {_gib(p.memory.weights)} GiB of weights per GPU"]
    if p.layout.weights != "fp8":
        ways.append("--weights fp8")
    return "e.g. " + ", ".join(ways) + f" or shorter sequences than {w.positions} positions"


def _shortfall(p: ServePlan, w: Workload) -> str:
    """Why the best-ranked layout does not serve the workload ("" when it does)."""
    if p.meets:
        return ""
    closest = "no layout meets the targets: the closest" if w.has_targets else "no layout serves it: the closest"
    return f" ({'; '.join(p.reasons)}; {closest})"


def _decode_line(p: ServePlan) -> str:
    """The decode step: one forward, or with pp the micro-batches in flight and the busiest rank's share
    (saturated: at the most sequences that fit)."""
    batch = p.at.batch if p.at.stable else max(p.fit, 1)
    at = f"batch {batch:.1f}" if p.at.stable else f"its full batch of {batch} (saturated)"
    line = f"  decode step at {at}: {_ms(p.step_s)} ms"
    if p.layout.pp == 1:
        return f"{line} = {_parts(p.decode)}"
    k = in_flight(p.layout, batch)
    return (
        f"{line} between a sequence's tokens: {k:g} micro-batches of {batch / k:.1f} in flight, each forward "
        f"{_ms(p.decode.total)} ms = {_parts(p.decode)}; the busiest pipeline rank takes "
        f"{_ms(p.decode.interval)} ms of it"
    )


def _training(train: TrainingView, m: ModelConfig, cluster: Cluster) -> list[str]:
    head = (
        f"training layout (`fived plan`, seq {train.seq_len}, {train.global_batch * train.seq_len:,} tokens per "
        f"step) on the same {cluster.gpus} GPU{'s' if cluster.gpus > 1 else ''}:"
    )
    if train.plan is not None:
        p = train.plan
        return [
            head,
            f"  {p.layout.describe()}: {_gib(p.memory.total)} GiB per GPU, step {p.time.total:.3g} s, "
            f"MFU {p.time.mfu:.1%}",
        ]
    out = [
        head,
        f"  none fits: the least memory any training layout needs is {train.least_gib:.1f} GiB per GPU of "
        f"{cluster.hardware.memory_gib:g}",
    ]
    if train.plan_there is not None:
        p = train.plan_there
        out.append(
            f"  on {train.fits_at} GPUs: {p.layout.describe()}: {_gib(p.memory.total)} GiB per GPU, step "
            f"{p.time.total:.3g} s, MFU {p.time.mfu:.1%}"
        )
    return out


def to_json(
    plans: list[ServePlan],
    m: ModelConfig,
    cluster: Cluster,
    w: Workload,
    top: int,
    source: str,
    train: TrainingView | None,
) -> dict:
    path, first = model_path(source, m.name)
    out = {
        "model": m.name,
        "gpus": cluster.gpus,
        "gpu": cluster.hardware.name,
        "workload": {
            **vars(w),
            "ttft_s": None if w.ttft_s == float("inf") else w.ttft_s,
            "tpot_s": None if w.tpot_s == float("inf") else w.tpot_s,
        },
        "plans": [p.to_dict() for p in plans[:top]],
    }
    if plans:
        out["vllm"] = vllm_command(plans[0], w, path, m)
        out["vllm_mismatch"] = vllm_mismatch(m, plans[0].layout)
        out["export"] = first
    if train is not None:
        plan = train.plan or train.plan_there
        out["training"] = {
            "fits": train.plan is not None,
            "least_gib": train.least_gib,
            "fits_at_gpus": train.fits_at,
            "plan": plan.to_dict(train.global_batch) if plan is not None else None,
            "why": why_they_differ(plans[0], train, m, w) if plans else [],
        }
    return out
