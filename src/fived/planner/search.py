"""`fived plan`: enumerate the layouts a model can run with on a cluster, keep those that fit in
memory, rank them by predicted step time, and say why the winner wins.

The enumeration bounds (what "every valid layout" leaves out, on purpose): tp up to two nodes'
worth of GPUs (beyond, every TP collective crosses the network), cp up to 32 (as a ring, Ulysses, or
Ulysses groups of any size that splits the heads joined by a ring), virtual stages 2 and
4 for the interleaved schedules, micro-batches of 1, 2, 4, 8 sequences but no more than
MICRO_BATCH_TOKENS tokens, and HSDP only as "shard inside a node, replicate across nodes".

Order of decisions (the background notes' recipe): fit memory first, then reach the global batch
(micro-batch size x micro-batches x dp), then maximise throughput. Validity is the runtime's own
check (`fived.layout.rules.layout_errors`, asked by `fived.planner.validity`), so every planned layout is one `fived train` accepts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from operator import attrgetter

from fived.config import CpMode, ModelConfig
from fived.layout.layout import Layout
from fived.planner.constants import Constants
from fived.planner.layout_cache import collector_paused
from fived.planner.memory import MemoryEstimate, StateMemory, memory_per_gpu, reserve_bytes
from fived.planner.pricing import Candidate, price
from fived.planner.runtimes import FIVED, Runtime
from fived.planner.timing import Cluster, StepTime, step_time
from fived.planner.validity import CoreValidity, is_valid, with_usable_overlap

SCHEDULES = (
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("interleaved-1f1b", 4),
    ("zero-bubble", 2),
    ("zbv", 1),
    ("dualpipev", 1),
    ("gpipe", 1),
)
MICRO_BATCHES = (1, 2, 4, 8)
# A micro-batch of this many tokens already fills the GEMMs; larger ones only add memory and bubble.
MICRO_BATCH_TOKENS = 8192


@dataclass
class Plan:
    layout: Layout
    memory: MemoryEstimate
    time: StepTime
    capacity: int  # bytes of device memory a plan may use (the device's, less the headroom)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    def to_dict(self, global_batch: int, runtime: Runtime = FIVED) -> dict:
        return {
            "layout": self.layout.to_dict(),
            "describe": self.layout.describe(),
            "flags": run_flags(self.layout, global_batch, runtime),
            "memory_gib": self.memory.gib(),
            "capacity_gib": self.capacity / 2**30,
            "step": self.time.to_dict(),
            "runnable": self.layout.runnable,
        }


def run_flags(layout: Layout, global_batch: int, runtime: Runtime) -> str:
    """`fived train`'s flags that run `layout` as `runtime` prices it: the layout's own and, for fived,
    the compiled blocks and FP8 the price assumed. The one source of `fived plan`'s `run it` command,
    its --json flags and the explore page's command (`run_flag_pairs`' pairs, joined)."""
    return " ".join(run_flag_pairs(layout, global_batch, runtime))


def run_flag_pairs(layout: Layout, global_batch: int, runtime: Runtime) -> list[str]:
    """`run_flags` as its "--name value" pairs."""
    pairs = layout.flag_pairs(global_batch)
    if runtime.is_fived and runtime.fused:
        pairs.append("--train.compile true")
    if runtime.is_fived and runtime.fp8:
        pairs.append("--train.fp8 rowwise")
    return pairs


def train_command(model_arg: str, seq_len: int, dtype: str) -> str:
    """What precedes `run_flags` in a `fived train` command (`model_arg`: --model NAME or --config FILE)."""
    return f"fived train {model_arg} --train.seq_len {seq_len} --train.dtype {dtype}"


def reduction_choices(layout: Layout, runtime: Runtime) -> list[Layout]:
    """fived's ZeRO-2 with overlapped buckets both ways: reducing after the last micro-batch, and every
    micro-batch (parallel.zero2_reduce_every_microbatch: a reduction to hide under each backward, but
    micro-batches times the bytes and a float32 shard in bf16 runs); the planner keeps it where faster."""
    if runtime.is_fived and layout.zero == 2 and layout.overlap_grad_reduce:
        return [layout, layout.with_(zero2_reduce_every_microbatch=True)]
    return [layout]


def fastest_fitting(plans: list) -> Plan | None:
    """The first plan that fits and is strictly faster than those before it (else the first)."""
    best = plans[0]
    for p in plans[1:]:
        if p is not None and p.fits and (best is None or not best.fits or p.time.total < best.time.total):
            best = p
    return best


def evaluate(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str = "bfloat16",
    runtime: Runtime = FIVED,
    headroom_gib: float = 0.0,
    checked: bool = False,
    constants: Constants | None = None,
) -> Plan | None:
    """The plan of one layout (None if it cannot run; `checked`: the caller already knows it can),
    priced with `constants` (default: the shipped calibration's)."""
    if not checked and not is_valid(model, layout, seq_len, global_batch):
        return None
    return plan_of(model, layout, cluster, seq_len, global_batch, dtype, runtime, headroom_gib, constants)


def plan_of(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str = "bfloat16",
    runtime: Runtime = FIVED,
    headroom_gib: float = 0.0,
    constants: Constants | None = None,
) -> Plan:
    """The plan of a layout known to run: its memory per GPU and predicted step time."""
    hw = cluster.hardware
    memory = memory_per_gpu(model, layout, seq_len, global_batch, dtype, hw.memory_gib, runtime)
    return Plan(
        layout,
        memory,
        step_time(model, layout, cluster, seq_len, global_batch, dtype, runtime, constants=constants),
        capacity_bytes(hw.memory_gib, headroom_gib),
    )


def _fitting_choices(
    layout: Layout,
    global_batch: int,
    runtime: Runtime,
    valid: CoreValidity,
    memories: list[StateMemory],
    capacity: int,
) -> list[tuple[Layout, MemoryEstimate]] | int | None:
    """The first pass's look at one layout, by memory alone: its `reduction_choices` that fit with
    their memory, or the least memory a choice needed when none fits, or None when none can run.
    `valid`: its core's `CoreValidity`; `memories`: each choice's state's `StateMemory`, in
    `reduction_choices`' order."""
    choices = reduction_choices(layout, runtime)
    # (the choices differ in zero2_reduce_every_microbatch alone, whose one rule, zero 2 with
    # overlap_grad_reduce, they meet by construction: one runs iff the other does)
    if not valid.accepts(choices[0]):
        return None
    estimates = [memory.of(x, global_batch) for memory, x in zip(memories, choices)]
    fits = [(x, mem) for x, mem in zip(choices, estimates) if mem.total <= capacity]
    return fits or estimates[0].total


def capacity_bytes(memory_gib: float, headroom_gib: float) -> int:
    return int((memory_gib - headroom_gib) * 2**30)


def expand(base: Layout, options: dict) -> list[Layout]:
    """Every completion of `base` with one value per open field (pp_schedule values: (name, v))."""
    names = list(options)
    out = []
    for values in itertools.product(*(options[n] for n in names)):
        changes: dict = {}
        for name, value in zip(names, values):
            if name == "pp_schedule":
                changes.update(pp_schedule=value[0], pp_virtual=value[1])
            else:
                changes[name] = value
        out.append(base.with_(**changes))
    return out


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def mesh_shapes(
    model: ModelConfig, gpus: int, gpus_per_node: int, seq_len: int, global_batch: int, *, folded: bool = False
):
    """(dp, tp, pp, cp, ep) products equal to the GPU count, with the cheap divisibility rules; with
    `folded`, also Megatron-Core's MoE parallel folding (experts over dp*cp*tp, etp 1)."""
    for tp in _divisors(gpus, 2 * gpus_per_node):
        if model.n_heads % tp:
            continue
        for cp in _divisors(gpus // tp, 32):
            if cp > 1 and seq_len % (2 * cp):
                continue
            for pp in _divisors(gpus // (tp * cp), model.n_layers):
                dp = gpus // (tp * cp * pp)
                if global_batch % dp:
                    continue
                eps = (
                    [e for e in _divisors(dp * cp, model.n_experts) if model.n_experts % e == 0]
                    if model.is_moe
                    else [1]
                )
                for ep, (mode, u) in itertools.product(eps, cp_modes(model, tp, cp)):
                    yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, cp_mode=mode, cp_ulysses=u)
                if folded and model.is_moe and tp > 1:
                    for ep in _divisors(dp * cp * tp, model.n_experts):
                        if model.n_experts % ep == 0 and ep > 1:
                            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=1)


def cp_modes(model: ModelConfig, tp: int, cp: int) -> list[tuple[CpMode, int]]:
    """(cp_mode, cp_ulysses) choices of a cp degree: the ring, and Ulysses over every group size whose
    ranks can split the heads of a tp rank (all of cp: ulysses; a divisor between: hybrid)."""
    out: list[tuple[CpMode, int]] = [("ring", Layout.cp_ulysses)]
    heads, kv = model.n_heads // tp, max(model.n_kv_heads // tp, 1)
    for u in _divisors(cp, cp)[1:]:
        if heads % u == 0 and (kv % u == 0 or u % kv == 0):
            out.append(("ulysses", Layout.cp_ulysses) if u == cp else ("hybrid", u))
    return out


def state_choices(model: ModelConfig, mesh: Layout, gpus_per_node: int):
    """ZeRO stage, HSDP replicas and pipeline schedule: what decides the model-state bytes."""
    schedules = (
        [("1f1b", 1)]
        if mesh.pp == 1
        else [s for s in SCHEDULES if model.n_layers >= mesh.pp * (2 if s[0] in ("zbv", "dualpipev") else s[1])]
    )
    for zero in (0, 1, 2, 3):
        replicas = [1]
        hsdp = node_replicas(mesh, zero, gpus_per_node)
        if hsdp:
            replicas.append(hsdp)
        for dp_replicate, (schedule, v) in itertools.product(replicas, schedules):
            yield mesh.with_(zero=zero, dp_replicate=dp_replicate, pp_schedule=schedule, pp_virtual=v)


def node_replicas(mesh: Layout, zero: int, gpus_per_node: int) -> int | None:
    """The HSDP the planner weighs: ZeRO shards inside a node, replicated across nodes; its replicas
    (dp_replicate), or None where it does not apply (ZeRO-0, experts, a dp of one node or less)."""
    node_shard = max(1, gpus_per_node // (mesh.tp * mesh.cp))
    if zero and mesh.ep == 1 and 1 < node_shard < mesh.dp and mesh.dp % node_shard == 0:
        return mesh.dp // node_shard
    return None


def activation_choices(layout: Layout, seq_len: int, global_batch: int):
    """Micro-batch size, sequence parallelism, checkpointing: what decides the activation bytes.
    Checkpointing last, cheapest first: more of it only ever costs time. (Each option's layouts are
    built as they are asked for: the search stops at the first that fits, most often the first.)"""
    for mbs, sp in itertools.product(MICRO_BATCHES, (False, True) if layout.tp > 1 else (False,)):
        if (global_batch // layout.dp) % mbs == 0 and (mbs == 1 or mbs * seq_len <= MICRO_BATCH_TOKENS):
            yield _checkpointing_options(layout, mbs, sp)


def _checkpointing_options(layout: Layout, mbs: int, sp: bool):
    for ac in ("none", "selective", "full"):
        yield layout.with_(micro_batch=mbs, sp=sp, checkpointing=ac)


DECISIONS = (
    "tp",
    "pp",
    "cp",
    "cp_mode",
    "ep",
    "etp",
    "zero",
    "dp_replicate",
    "sp",
    "pp_schedule",
    "micro_batch",
    "checkpointing",
)


_decision_values = attrgetter(*DECISIONS)
OPTION_DECISIONS = ("sp", "micro_batch", "checkpointing")  # what a state's activation options vary
CORE_DECISIONS = tuple(d for d in DECISIONS if d not in OPTION_DECISIONS)
_option_decision_values, _core_decision_values = attrgetter(*OPTION_DECISIONS), attrgetter(*CORE_DECISIONS)


@dataclass
class Search:
    plans: list[Plan]  # every fitting plan, fastest first (plan(keep=K): every one that can matter, see there)
    considered: int  # valid layouts looked at
    smallest: dict  # (decision, value) -> least memory (bytes) any layout with it needed
    fitting: int  # fitting layouts (len(plans) unless plan(keep=K) left some unpriced)


@collector_paused()
def plan(
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str = "bfloat16",
    runtime: Runtime = FIVED,
    headroom_gib: float = 0.0,
    *,
    keep: int | None = None,
) -> Search:
    """Every fitting plan, fastest first: a plan fits when its peak stays `headroom_gib` below the
    device's memory. Layouts whose model state alone overflows are dropped before their activation
    options are costed; of the checkpointing options of one layout, the first that fits is kept (the
    others only recompute more). Every runtime considers MoE parallel folding (etp 1: experts whole,
    ep over dp*cp*tp), which fived runs too. With `keep`, a fitting layout is priced only if it can be
    among the `keep` fastest or the fastest with one of its decisions' values (`fived.planner.pricing`): the plans'
    first `keep`, the runners-up and every figure `explain` prints are those of the whole search."""
    capacity = capacity_bytes(cluster.hardware.memory_gib, headroom_gib)
    reserve = reserve_bytes(cluster.hardware.memory_gib)
    gib = cluster.hardware.memory_gib
    candidates: list[Candidate] = []
    considered, smallest = 0, dict[tuple, int]()

    def note(layout: Layout, need: int, decisions=DECISIONS, values=_decision_values) -> None:
        for k in zip(decisions, values(layout)):
            found = smallest.get(k)
            if found is None or need < found:
                smallest[k] = need

    # first pass, memory alone: what is valid, what fits (the first checkpointing option that does)
    for mesh in mesh_shapes(model, cluster.gpus, cluster.gpus_per_node, seq_len, global_batch, folded=True):
        for state in state_choices(model, mesh, cluster.gpus_per_node):
            if runtime.is_fived:  # fived's candidates run with every overlap they can use
                state = with_usable_overlap(model, state, seq_len, global_batch, fp8=runtime.fp8)
            # (the activation options share their state's core and model state: one of each per choice)
            choices = reduction_choices(state, runtime)  # (the state itself first)
            memories = [StateMemory(model, state, seq_len, dtype, gib, runtime)]
            floor = memories[0].state_floor() + reserve
            if floor > capacity:
                if is_valid(model, state, seq_len, global_batch):
                    considered += 1
                    note(state, floor)
                continue
            valid = CoreValidity(model, state, seq_len, global_batch)
            memories += [StateMemory(model, x, seq_len, dtype, gib, runtime) for x in choices[1:]]
            least = None  # the least memory noted of the state's options: their core decisions' (noted once)
            for options in activation_choices(state, seq_len, global_batch):
                for layout in options:
                    result = _fitting_choices(layout, global_batch, runtime, valid, memories, capacity)
                    if result is None:  # e.g. selective checkpointing under a split-backward schedule
                        continue
                    considered += 1
                    if isinstance(result, int):  # nothing fits: the least memory a choice needed
                        note(layout, result, OPTION_DECISIONS, _option_decision_values)
                        least = result if least is None or result < least else least
                        continue
                    c = Candidate(len(candidates), layout, result, needs=frozenset(m.total for _, m in result))
                    need = c.one_memory
                    if need is not None:  # (else noted once priced: which choice is kept decides)
                        note(layout, need, OPTION_DECISIONS, _option_decision_values)
                        least = need if least is None or need < least else least
                    candidates.append(c)
                    break
            if least is not None:  # (its options share every other decision's value)
                note(state, least, CORE_DECISIONS, _core_decision_values)

    # second pass: step times, of every fitting layout or (keep) of those that can matter
    def plan_of(c: Candidate) -> Plan | None:
        timed = (
            Plan(x, m, step_time(model, x, cluster, seq_len, global_batch, dtype, runtime), capacity) for x, m in c.fits
        )
        return fastest_fitting(list(timed))

    plans = price(
        candidates,
        model,
        cluster,
        seq_len,
        global_batch,
        dtype,
        runtime,
        plan_of,
        keep=keep,
        decisions=DECISIONS,
        smallest=smallest,
        note=note,
    )
    return Search(plans, considered, smallest, len(candidates))
