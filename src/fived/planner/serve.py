"""`fived plan --serve`: which serving layout (tp, pp, data-parallel replicas, ep, bf16/fp8 weights) to
run a model with on a cluster for a workload, ranked by the output tokens/s it delivers within the
latency targets. What one forward costs comes from `fived.planner.serve_model`; this module puts it
under a workload.

The queueing model (per data-parallel replica; `dp` replicas share the requests evenly). Prompt and
output lengths are fixed (every request the same; no length distributions).
- A replica's forwards: one prefill has a latency S (the pipeline ranks one after another) and
  occupies the busiest pipeline rank for s (S itself without pp). With pipeline parallelism the
  replica keeps pp batches in flight, as vLLM's --pipeline-parallel-size does: its b sequences
  decode as k = min(pp, b) micro-batches of b/k, and a sequence's next token comes after its
  micro-batch's forward (latency L) or after k forwards of the busiest rank (k x its occupancy l),
  whichever is longer: the decode step step(b) = max(L(b/k), k l(b/k)) (pp = 1: the forward).
- Continuous batching with prefill priority, as vLLM's scheduler runs by default: a request's prompt
  is prefilled at the next step boundary, then it joins the running batch, one token per decode step.
- Open loop (`--rate R`): Poisson arrivals at r = R/dp per replica. Prefills take the busiest rank
  rho = r x s of its time; decode steps get the rest, so a token takes TPOT = step(b) / (1 - rho)
  on average, and by Little's law the decode batch is b = r x O x TPOT (O output tokens): a fixed
  point, found by iteration; none (b grows past what the KV cache holds, or rho >= 1) means the
  replica is saturated.
- TTFT: the prefill queue is M/D/1 (deterministic service s at utilisation rho), waiting time taken
  as exponential beyond its P(wait > 0) = rho with the Pollaczek-Khinchine mean rho s / (2(1 - rho));
  TTFT = S + the decode forward occupying the first rank when the request arrives (half of one on
  average, a whole one at p99) + the wait (its mean, its 99th percentile).
- TPOT as serving benchmarks report it (a request's mean time per output token after the first):
  the step time plus the prefills that interrupt its O tokens, a Poisson count of mean r x O x TPOT;
  p99 TPOT = step(b) + s x (99th percentile of that count) / O.
- Closed loop (`--concurrency C`): C/dp requests per replica, each sent when the previous ends;
  b = min(C/dp, sequences the KV cache holds) decode together, the rest wait for a slot; the replica
  is never idle, so prefills and steps fill its busiest rank's time: X s + (X O / b) step(b) = 1
  gives the request rate X; its latencies are the open loop's at rate X with the other b - 1
  requests' share (b-1)/b of the prefills (one client never waits for itself), + the wait for a slot.
- Goodput: the largest rate whose p99 TTFT and p99 TPOT meet the targets (bisection), times O and dp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fived.config import ModelConfig
from fived.planner.serve_model import (
    KV_DTYPES,
    SERVING_WEIGHTS,
    ForwardTime,
    GpuMemory,
    ServeLayout,
    forward_time,
    gpu_memory,
    sequences_that_fit,
)
from fived.planner.timing import Cluster

QUANTILE = 0.99
FIXED_POINT_STEPS = 60
BISECTION_STEPS = 40


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    output_len: int
    rate: float = 0.0  # requests/s over the cluster (open loop); 0: not given
    concurrency: int = 0  # requests in flight over the cluster (closed loop); 0: not given
    ttft_s: float = math.inf  # p99 targets
    tpot_s: float = math.inf
    kv_dtype: str = "bf16"

    @property
    def positions(self) -> int:
        """Positions a sequence's cache holds: its prompt and every output token."""
        return self.prompt_len + self.output_len

    @property
    def kv_bytes(self) -> int:
        return KV_DTYPES[self.kv_dtype]

    @property
    def has_targets(self) -> bool:
        return math.isfinite(self.ttft_s) or math.isfinite(self.tpot_s)


@dataclass
class Operating:
    """A replica at an operating point: mean decode batch, request rate, latencies (seconds)."""

    batch: float
    rate: float  # requests/s per replica
    step_s: float  # between two tokens of a sequence at the batch (`Replica.step`)
    tpot_s: float  # mean time per output token (steps slowed by prefills)
    ttft_s: float  # mean time to first token
    p99_ttft_s: float
    p99_tpot_s: float
    stable: bool = True


SATURATED = Operating(math.inf, 0.0, math.inf, math.inf, math.inf, math.inf, math.inf, stable=False)


@dataclass
class ServePlan:
    layout: ServeLayout
    memory: GpuMemory  # the busiest GPU at the operating batch
    fit: int  # sequences one replica's KV cache holds
    prefill: ForwardTime  # one prompt
    decode: ForwardTime  # one decode forward at the operating batch (of a micro-batch with pp)
    step_s: float  # between two tokens of a sequence at the operating batch, no prefill between
    at: Operating  # at the workload (or at the goodput's rate when the workload gives neither)
    goodput: float  # output tokens/s the cluster sustains within the targets
    throughput: float  # output tokens/s at the workload
    meets: bool
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "layout": vars(self.layout),
            "describe": self.layout.describe(),
            "memory_gib": self.memory.gib(),
            "memory_bytes": {k: getattr(self.memory, k) for k in ("weights", "kv_cache", "activations", "reserve")},
            "sequences_per_replica": self.fit,
            "prefill_ms": self.prefill.total * 1e3,
            "decode_forward_ms": self.decode.total * 1e3,
            "decode_step_ms": self.step_s * 1e3,
            "ttft_ms": self.at.ttft_s * 1e3,
            "decode_parts_ms": _parts_ms(self.decode),
            "prefill_parts_ms": _parts_ms(self.prefill),
            "batch": self.at.batch,
            "tpot_ms": self.at.tpot_s * 1e3,
            "p99_ttft_ms": self.at.p99_ttft_s * 1e3,
            "p99_tpot_ms": self.at.p99_tpot_s * 1e3,
            "goodput_tokens_per_s": self.goodput,
            "throughput_tokens_per_s": self.throughput,
            "meets_targets": self.meets,
            "reasons": self.reasons,
        }


def _parts_ms(t: ForwardTime) -> dict:
    return {k: getattr(t, k) * 1e3 for k in ("compute", "tp", "ep", "pp", "host")}


def in_flight(layout: ServeLayout, batch: float) -> float:
    """Micro-batches a replica decodes at once: pp of them (vLLM's batches in flight), fewer when it
    has fewer sequences."""
    return min(float(layout.pp), max(batch, 1.0))


class Replica:
    """One data-parallel replica of a layout serving a workload: its forward times and queueing."""

    def __init__(self, m: ModelConfig, layout: ServeLayout, cluster: Cluster, w: Workload, fit: int):
        self.m, self.layout, self.cluster, self.w, self.fit = m, layout, cluster, w, fit
        self.prefill = self.forward(1, w.prompt_len, w.prompt_len)

    def forward(self, sequences: float, new_tokens: int, context: float) -> ForwardTime:
        return forward_time(
            self.m,
            self.layout,
            self.cluster,
            sequences=sequences,
            new_tokens=new_tokens,
            context=context,
            kv_bytes=self.w.kv_bytes,
        )

    @property
    def prefill_s(self) -> float:
        """How long one prefill occupies the replica's busiest pipeline rank (the queue's service time)."""
        return self.prefill.interval

    def decode(self, batch: float) -> ForwardTime:
        """One decode forward of a micro-batch of the replica's `batch` sequences, at the mean context
        (prompt + half the output)."""
        return self.forward(
            max(batch / in_flight(self.layout, batch), 1.0), 1, self.w.prompt_len + self.w.output_len / 2
        )

    def step(self, batch: float) -> float:
        """Seconds between two tokens of a sequence with `batch` sequences decoding (no prefill between):
        its micro-batch's forward, or the busiest rank's turn at every micro-batch in flight if longer."""
        forward = self.decode(batch)
        return max(forward.total, in_flight(self.layout, batch) * forward.interval)

    def static_batch_s(self, batch: int) -> float:
        """One batch of `batch` prompts generated together to the end (an offline latency benchmark), one
        batch in flight: one prefill of every prompt, then output_len - 1 decode forwards."""
        w = self.w
        prefill = self.forward(batch, w.prompt_len, w.prompt_len).total
        return prefill + (w.output_len - 1) * self.forward(batch, 1, w.prompt_len + w.output_len / 2).total

    def latencies(self, rate: float, batch: float, step_s: float, tpot_s: float, others: float) -> Operating:
        """Latencies at `rate` requests/s with `others` sequences decoding when a request arrives: it waits
        for the decode forward on the first rank (half of one on average) and for the prefills queued
        ahead (M/D/1), and its tokens for the prefills of arrivals, of which a share others/batch are
        other requests' (a closed loop's one client never waits for itself)."""
        s, o = self.prefill_s, self.w.output_len
        rho = rate * s
        busy = min(1.0, others) * self.decode(batch).interval
        share = min(1.0, others / batch) if batch > 0 else 0.0
        mean_wait = rho * s / (2 * (1 - rho)) * share
        interruptions = poisson_quantile(rate * share * o * tpot_s, QUANTILE)
        first = self.prefill.total
        return Operating(
            batch,
            rate,
            step_s,
            tpot_s,
            first + busy / 2 + mean_wait,
            first + busy + _p99_wait(rho, s) * share,
            step_s + s * interruptions / o,
        )

    def open_loop(self, rate: float) -> Operating:
        """At Poisson arrivals of `rate` requests/s: the decode batch by Little's law (fixed point)."""
        s, o = self.prefill_s, self.w.output_len
        rho = rate * s
        if rho >= 1:
            return SATURATED
        batch = 0.0
        for _ in range(FIXED_POINT_STEPS):
            new = rate * o * self.step(batch) / (1 - rho)
            if new > self.fit:
                return SATURATED
            if abs(new - batch) <= 1e-6 * max(new, 1.0):
                batch = new
                break
            batch = new
        else:
            return SATURATED
        step = self.step(batch)
        return self.latencies(rate, batch, step, step / (1 - rho), others=batch)

    def closed_loop(self, concurrency: float) -> Operating:
        """`concurrency` requests in flight, each sent when the previous ends: the replica is never
        idle, its busiest rank's time split between prefills and decode steps, X s + (X O / b) step = 1."""
        batch = min(concurrency, self.fit)
        if batch <= 0:
            return SATURATED
        s, o = self.prefill_s, self.w.output_len
        step = self.step(batch)
        rate = batch / (batch * s + o * step)
        others = (batch - 1) / batch  # the share of prefills that are other requests'
        out = self.latencies(rate, batch, step, step / (1 - rate * s * others), others=batch - 1)
        queued = (concurrency - batch) / rate  # waiting for a free slot
        out.ttft_s += queued
        out.p99_ttft_s += queued
        return out

    def cluster_closed_loop(self, concurrency: int, replicas: int) -> tuple[Operating, float]:
        """`concurrency` clients spread over `replicas` (some hold one more): the busiest replica's
        latencies and the cluster's output tokens/s."""
        low, extra = divmod(concurrency, replicas)
        rate = sum(n * self.closed_loop(c).rate for n, c in ((extra, low + 1), (replicas - extra, low)) if n and c)
        return self.closed_loop(low + 1 if extra else low), rate * self.w.output_len

    def meets(self, op: Operating) -> bool:
        return op.stable and op.p99_ttft_s <= self.w.ttft_s and op.p99_tpot_s <= self.w.tpot_s

    def goodput_rate(self) -> float:
        """The largest request rate whose p99 latencies meet the targets (0 if none)."""
        low, high = 0.0, 1.0 / self.prefill_s
        if not self.meets(self.open_loop(high * 1e-6)):
            return 0.0
        for _ in range(BISECTION_STEPS):
            mid = (low + high) / 2
            low, high = (mid, high) if self.meets(self.open_loop(mid)) else (low, mid)
        return low


def _p99_wait(rho: float, service_s: float) -> float:
    """99th percentile of an M/D/1 queue's wait: P(wait > 0) = rho, exponential beyond, with the
    Pollaczek-Khinchine mean rho S / (2 (1 - rho))."""
    if rho <= 1 - QUANTILE:
        return 0.0
    mean = rho * service_s / (2 * (1 - rho))
    return mean / rho * math.log(rho / (1 - QUANTILE))


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest k with P(Poisson(mean) <= k) >= q."""
    if mean <= 0:
        return 0
    if mean > 500:  # normal approximation (the sum below underflows)
        return math.ceil(mean + 2.326 * math.sqrt(mean))
    k, term = 0, math.exp(-mean)
    total = term
    while total < q:
        k += 1
        term *= mean / k
        total += term
    return k


def evaluate(
    m: ModelConfig, layout: ServeLayout, cluster: Cluster, w: Workload, headroom_gib: float = 0.0
) -> ServePlan:
    """The serving plan of one layout: memory, forward times, the workload's operating point, goodput."""
    hw = cluster.hardware
    capacity = int((hw.memory_gib - headroom_gib) * 2**30)
    fit = sequences_that_fit(
        m, layout, hw, capacity, positions=w.positions, forward_tokens=w.prompt_len, kv_bytes=w.kv_bytes
    )
    replica = Replica(m, layout, cluster, w, fit)
    rate = replica.goodput_rate() if fit else 0.0
    if w.rate:
        at = replica.open_loop(w.rate / layout.dp) if fit else SATURATED
        throughput = w.rate * w.output_len if at.stable else 0.0
    elif w.concurrency:
        at, throughput = replica.cluster_closed_loop(w.concurrency, layout.dp) if fit else (SATURATED, 0.0)
    else:
        at = replica.open_loop(rate) if rate else SATURATED
        throughput = rate * layout.dp * w.output_len
    meets = fit > 0 and replica.meets(at)
    batch = math.ceil(at.batch) if at.stable else fit
    memory = gpu_memory(
        m, layout, hw, sequences=batch, positions=w.positions, forward_tokens=w.prompt_len, kv_bytes=w.kv_bytes
    )
    shown = at.batch if at.stable else max(fit, 1)  # (saturated: the most that fit)
    return ServePlan(
        layout,
        memory,
        fit,
        replica.prefill,
        replica.decode(shown),
        replica.step(shown),
        at,
        rate * layout.dp * w.output_len,
        throughput,
        meets,
        misses(fit, at, w, layout),
    )


def misses(fit: int, at: Operating, w: Workload, layout: ServeLayout) -> list[str]:
    """Why a layout does not serve the workload within the targets (empty when it does)."""
    if fit == 0:
        return ["the weights, one prompt's activations and the reserve leave no room for one sequence's KV cache"]
    if not at.stable:
        return [
            f"saturated: {w.rate:g} requests/s is more than its {layout.dp} replica(s) sustain"
            if w.rate
            else "no request rate meets the targets"
        ]
    out = []
    if at.p99_ttft_s > w.ttft_s:
        out.append(f"p99 TTFT {at.p99_ttft_s * 1e3:.0f} ms > target {w.ttft_s * 1e3:g} ms")
    if at.p99_tpot_s > w.tpot_s:
        out.append(f"p99 TPOT {at.p99_tpot_s * 1e3:.1f} ms > target {w.tpot_s * 1e3:g} ms")
    return out


def serving_layouts(m: ModelConfig, cluster: Cluster, weights: tuple[str, ...]):
    """Every (tp, pp, dp, ep, weights) using all the GPUs that fived's runtime accepts: tp inside a
    node, pp up to the layers, ep over the replicas dividing the experts; fp8 on GPUs with FP8 cores."""
    gpus = cluster.gpus
    for tp in (d for d in range(1, min(gpus, cluster.gpus_per_node) + 1) if gpus % d == 0):
        for pp in (d for d in range(1, min(gpus // tp, m.n_layers) + 1) if (gpus // tp) % d == 0):
            dp = gpus // (tp * pp)
            for ep in (e for e in range(1, dp + 1) if dp % e == 0 and (e == 1 or (m.is_moe and m.n_experts % e == 0))):
                layout = ServeLayout(tp=tp, pp=pp, dp=dp, ep=ep)
                if serving_refusal(m, layout) is None:
                    for dtype in weights:
                        if dtype == "bf16" or cluster.hardware.fp8_tflops > 0:
                            yield ServeLayout(tp=tp, pp=pp, dp=dp, ep=ep, weights=dtype)


def serving_refusal(m: ModelConfig, layout: ServeLayout):
    """Why fived's runtime cannot run `layout` (its training layout rules, one line), or None."""
    from fived.config import Config, ParallelConfig, TrainConfig
    from fived.layout.rules import layout_errors

    if layout.weights not in SERVING_WEIGHTS:
        from fived.config import ConfigError

        return ConfigError("--weights", layout.weights, "must be " + " or ".join(SERVING_WEIGHTS), "e.g. bf16")
    parallel = ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, ep=layout.ep)
    cfg = Config(
        model=m, parallel=parallel, train=TrainConfig(global_batch=layout.dp * layout.pp, microbatches=layout.pp)
    )
    errors = layout_errors(cfg, layout.gpus)
    return errors[0] if errors else None


def rank_plans(plans: list[ServePlan], w: Workload) -> list[ServePlan]:
    """Layouts meeting the workload first, then those holding at least one sequence; then by output
    tokens/s (at the workload with --concurrency, else the goodput), then the lower p99 TTFT, then the
    less memory per GPU (among layouts holding no sequence: the closest to holding one)."""
    score = (lambda p: p.throughput) if w.concurrency else (lambda p: p.goodput)
    return sorted(plans, key=lambda p: (not p.meets, p.fit == 0, -score(p), p.at.p99_ttft_s, p.memory.total))


def plan_serving(
    m: ModelConfig, cluster: Cluster, w: Workload, weights: tuple[str, ...] = ("bf16", "fp8"), headroom_gib: float = 0.0
) -> list[ServePlan]:
    """Every serving layout of the cluster, evaluated and ranked."""
    return rank_plans(
        [evaluate(m, layout, cluster, w, headroom_gib) for layout in serving_layouts(m, cluster, weights)], w
    )


def gpus_needed(plan: ServePlan, w: Workload) -> int:
    """GPUs of this layout's shape that sustain the workload's rate within the targets (0: none do)."""
    per_replica = plan.goodput / plan.layout.dp / w.output_len
    if not w.rate or per_replica <= 0:
        return 0
    replicas = math.ceil(w.rate / per_replica / plan.layout.ep) * plan.layout.ep
    return replicas * plan.layout.tp * plan.layout.pp
