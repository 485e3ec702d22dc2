"""`fived explore`: the planner's figures for every layout the page's toggles can reach, as one JSON
document the page (`fived.tools.pages`) only looks values up in.

The toggles span the values `fived plan` searches for this model and cluster (`toggle_options`: the
tp, cp, pp and ep of its mesh shapes, folded ones included, its schedules and virtual stages, its micro-batch sizes), plus
sp, etp (MoE parallel folding), the ZeRO stage, its HSDP (ZeRO shards inside a node, replicas across nodes) and activation
checkpointing; dp is what the GPU count leaves (gpus / (tp*pp*cp)). Each reachable combination is
either priced as the planner prices it (`fived.planner.search.evaluate` with the overlaps fived
turns on: memory per GPU, step time, the collectives of `fived.planner.communication` with the
links `fived.planner.timing` puts them on, the flags that run it) or refused with the runtime's own
one-line reason (`fived.layout.rules.layout_errors`, then torch's schedule rules). The page opens on
the planner's best layout and lists its ranking (`ranking`). The layer map's local shapes come from
`fived.planner.layer_map`, the pipeline timeline from `fived.layout.schedule_sim`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

from fived.config import ConfigError, ModelConfig
from fived.layout.layout import CHECKPOINTING, MESH_FIELDS, PP_SCHEDULES, Layout, stages_per_rank
from fived.layout.schedule_sim import n_stages_of, pipeline_profile, schedule_timeline
from fived.layout.stages import model_key, model_of, rank_chunks, rank_stages
from fived.planner.communication import (
    data_parallel_collectives,
    data_parallel_layout,
    data_parallel_values,
    group_spans,
    model_parallel_collectives,
    model_parallel_layout,
    model_parallel_values,
)
from fived.planner.layer_map import activations, pipeline_ranks, replica_weights
from fived.planner.layout_cache import collector_paused, layout_memo
from fived.planner.links import in_node
from fived.planner.runtimes import PLANNED_RUNTIMES, Runtime, planned_runtime
from fived.planner.search import (
    MICRO_BATCH_TOKENS,
    MICRO_BATCHES,
    SCHEDULES,
    fastest_fitting,
    mesh_shapes,
    node_replicas,
    plan,
    plan_of,
    reduction_choices,
    run_flag_pairs,
    train_command,
)
from fived.planner.timing import Cluster
from fived.planner.validity import layout_refusal, with_usable_overlap
from fived.tools.explore_tables import (
    ENTRY_FIELDS,
    MAP_PARTS,
    EntryTables,
    Message,
    MessageTables,
)
from fived.tools.workers import Workers

MESH_TOGGLES = ("tp", "sp", "cp", "pp", "pp_schedule", "pp_virtual", "ep", "etp")  # (etp: MoE parallel folding)
TOGGLES = MESH_TOGGLES + ("zero", "hsdp", "micro_batch", "checkpointing")
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "reserve", "total")
TIME_PARTS = ("compute", "bubble", "tp", "cp", "ep", "pp", "dp", "optimizer", "overhead", "total")
TIMELINE_MICROBATCHES = 4  # per pipeline rank drawn: enough to show fill, steady state and drain
TIMELINE_MAX_PP = 16  # pipelines of more ranks: the bubble fraction, no timeline
RANKED = 8  # the planner's best layouts listed on the page
PROGRESS_STEPS = 100  # progress reports over a page's combinations


def toggle_options(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int) -> dict[str, list]:
    """The values each toggle offers: what `fived plan` searches for this model on this cluster (every
    tp, cp, pp and ep of its mesh shapes, folded ones included; a dense model has no ep or etp toggle:
    one value)."""
    meshes = list(mesh_shapes(model, cluster.gpus, cluster.gpus_per_node, seq_len, global_batch, folded=True))
    of = lambda name: sorted({getattr(m, name) for m in meshes} | {1})  # noqa: E731  (1: no parallelism)
    schedules = [s for s in PP_SCHEDULES if s in {name for name, _ in SCHEDULES}]
    return {
        "tp": of("tp"),
        "sp": [False, True],
        "cp": of("cp"),
        "pp": of("pp"),
        "pp_schedule": schedules,
        "pp_virtual": sorted({v for _, v in SCHEDULES}),
        "ep": of("ep"),
        "etp": [0, 1] if any(m.etp == 1 for m in meshes) else [0],  # (MoE parallel folding: parallel.etp)
        "zero": [0, 1, 2, 3],
        "hsdp": [False, True],
        "micro_batch": [m for m in MICRO_BATCHES if m == 1 or m * seq_len <= MICRO_BATCH_TOKENS],
        "checkpointing": list(CHECKPOINTING),
    }


def layout_key(layout: Layout) -> str:
    """The page's lookup key: the toggles' values in TOGGLES order (what the page's script builds)."""
    values = {**{name: getattr(layout, name) for name in TOGGLES if name != "hsdp"}, "hsdp": layout.dp_replicate > 1}
    return "|".join(str(values[name]).lower() for name in TOGGLES)


def toggle_values(layout: Layout) -> dict:
    """The toggles' values that show `layout` (for the page's ranking: click to load)."""
    return dict(zip(TOGGLES, layout_key(layout).split("|")))


def reachable_layouts(options: dict[str, list], cluster: Cluster):
    """(slot, Layout or the reason it cannot be set) for every combination of the toggles whose
    model-parallel size divides the GPU count (dp the rest); schedule and virtual stages only vary with
    pp > 1; HSDP where the planner would weigh it (`node_replicas`), else its reason. `slot` is the
    combination's position in `explore_data`'s entries (`slot` of its `layout_key`), computed from
    the values' positions directly (a million keys' strings cost more than pricing the layouts)."""
    for mesh in mesh_choices(options, cluster.gpus):
        yield from mesh_layouts(options, cluster, mesh)


def mesh_choices(options: dict[str, list], gpus: int) -> list[tuple]:
    """The toggles' ((index, tp), (index, sp), (index, cp), (index, pp)) whose tp*cp*pp divides `gpus`,
    in slot order."""
    mesh = itertools.product(*(enumerate(options[name]) for name in ("tp", "sp", "cp", "pp")))
    return [m for m in mesh if gpus % (m[0][1] * m[2][1] * m[3][1]) == 0]


def mesh_layouts(options: dict[str, list], cluster: Cluster, mesh: tuple):
    """`reachable_layouts`' combinations of one of `mesh_choices`."""
    gpus = cluster.gpus
    radix = [len(options[name]) for name in TOGGLES]
    weights = [math.prod(radix[i + 1 :]) for i in range(len(TOGGLES))]
    w = dict(zip(TOGGLES, weights))
    at = {name: {value: i for i, value in enumerate(options[name])} for name in TOGGLES}
    (i_tp, tp), (i_sp, sp), (i_cp, cp), (i_pp, pp) = mesh
    base = i_tp * w["tp"] + i_sp * w["sp"] + i_cp * w["cp"] + i_pp * w["pp"]
    # (each combination derived by with_: a dataclass __init__ per combination costs more)
    mesh_layout = Layout(dp=gpus // (tp * cp * pp), tp=tp, sp=sp, cp=cp, pp=pp)
    schedules = itertools.product(options["pp_schedule"], options["pp_virtual"]) if pp > 1 else [("1f1b", 1)]
    for (schedule, virtual), (i_ep, ep), (i_etp, etp), (i_zero, zero) in itertools.product(
        schedules, enumerate(options["ep"]), enumerate(options["etp"]), enumerate(options["zero"])
    ):
        head = base + at["pp_schedule"][schedule] * w["pp_schedule"] + at["pp_virtual"][virtual] * w["pp_virtual"]
        head += i_ep * w["ep"] + i_etp * w["etp"] + i_zero * w["zero"]
        core = mesh_layout.with_(pp_schedule=schedule, pp_virtual=virtual, ep=ep, etp=etp, zero=zero)
        settable = _settable(core, cluster)  # (per hsdp value: the layout to complete, or why it cannot be set)
        for (i_hsdp, hsdp), (i_mbs, mbs), (i_ac, ac) in itertools.product(
            enumerate(options["hsdp"]), enumerate(options["micro_batch"]), enumerate(options["checkpointing"])
        ):
            position = head + i_hsdp * w["hsdp"] + i_mbs * w["micro_batch"] + i_ac * w["checkpointing"]
            found = settable[hsdp]
            if isinstance(found, Layout):
                yield position, found.with_(micro_batch=mbs, checkpointing=ac)
            elif found is ETP_UNFOLDED:  # (its key is the layout's own: hsdp false)
                yield position - i_hsdp * w["hsdp"], found
            else:
                yield position, found


ETP_UNFOLDED = "etp: folding the experts (etp 1) needs tp > 1 to change anything; e.g. etp 0"


def _settable(core: Layout, cluster: Cluster) -> dict[bool, Layout | str]:
    """Per hsdp toggle value, the layout its combinations with `core` (a layout but its micro-batch
    and checkpointing) complete (HSDP's replicas filled in), or why none of them can be set."""
    if core.etp == 1 and not core.folded:  # (not priced twice: the same layouts as etp 0)
        return {False: ETP_UNFOLDED, True: ETP_UNFOLDED}
    replicas = node_replicas(core, core.zero, cluster.gpus_per_node)
    if replicas is None:
        return {
            False: core,
            True: f"hsdp: ZeRO shards inside a node (its {cluster.gpus_per_node // (core.tp * core.cp) or 1} "
            f"data-parallel ranks), replicated across nodes: needs ZeRO 1-3, ep 1 and "
            f"dp={core.dp} a multiple of them beyond one node; e.g. hsdp false",
        }
    return {False: core, True: core.with_(dp_replicate=replicas)}


def collectives(
    model: ModelConfig, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int, dtype: str
) -> tuple[tuple, ...]:
    """(group, op, bytes per step, calls per step, link, size, members, others) of pipeline rank 0's
    collectives (the planner's list, summed by group and op): the model-parallel ones, then the
    data-parallel ones, each memoised on the fields it reads (`fived.planner.communication`). The
    rows are the memos' own objects, shared by every layout they price alike: a worker's message
    pickles each once, and `explore_data` interns each once (a page's 1.4M rows are ~7k distinct)."""
    key, per_node = model_key(model), cluster.gpus_per_node
    reductions = _data_parallel_rows if layout.optimizer != "muon" else _rows_of_data_parallel
    return (
        *_model_parallel_rows(key, layout, per_node, seq_len, global_batch, dtype),
        *reductions(key, layout, per_node, global_batch, dtype),
    )


@layout_memo(maxsize=16384, values=model_parallel_values)
def _model_parallel_rows(key: tuple, layout: Layout, per_node: int, seq_len: int, global_batch: int, dtype: str):
    m, layout = model_of(key), model_parallel_layout(layout)  # (an entry: a function of its key)
    chunks, stages = rank_chunks(m, layout, 0), rank_stages(layout, 0)
    return _rows(model_parallel_collectives(m, layout, seq_len, global_batch, dtype, chunks, stages), layout, per_node)


@layout_memo(maxsize=16384, values=data_parallel_values)
def _data_parallel_rows(key: tuple, layout: Layout, per_node: int, global_batch: int, dtype: str):
    return _rows_of_data_parallel(key, data_parallel_layout(layout), per_node, global_batch, dtype)


def _rows_of_data_parallel(key: tuple, layout: Layout, per_node: int, global_batch: int, dtype: str):
    m = model_of(key)
    return _rows(data_parallel_collectives(m, layout, global_batch, dtype, rank_chunks(m, layout, 0)), layout, per_node)


def _rows(calls, layout: Layout, per_node: int) -> tuple[tuple, ...]:
    """`collectives`' rows of `calls` on `layout`'s mesh (`per_node` GPUs in a node)."""
    out = []
    spans = group_spans(layout)
    for (group, op), (total, n) in _merge(calls, {}).items():
        size, stride = spans[group]
        if size == 1:
            continue
        link = "NVLink" if in_node(per_node, stride, size) else "network"
        members, others = replica_members(layout.mesh_key, group)
        out.append((group, op, round(total), round(n, 3), link, size, members, others))
    return tuple(out)


def _merge(calls, merged: dict) -> dict:
    """Each priced collective's bytes and calls added to `merged`'s (group, op) entry."""
    for c in calls:
        if not c.part or c.total == 0:
            continue
        total, n = merged.get((c.group, c.op), (0.0, 0.0))
        merged[(c.group, c.op)] = (total + c.total, n + c.calls)
    return merged


@functools.lru_cache(maxsize=4096)
def replica_members(mesh_key: tuple, group: str) -> tuple[tuple[int, ...], int]:
    """(global ranks of rank 0's `group` inside the first model replica, how many lie outside it), on
    the mesh of `mesh_key` (`Layout.mesh_key`: the fields a group's ranks depend on): the replica is
    the pp x cp x tp ranks whose data-parallel index is 0 (`Layout.group_ranks`' mesh)."""
    layout = Layout(**dict(zip(MESH_FIELDS, mesh_key)))
    ranks = layout.group_ranks(group, 0)
    inside = tuple(sorted(r for r in ranks if r // (layout.tp * layout.cp) % layout.dp == 0))
    return inside, len(ranks) - len(inside)


# what `price` prices with unless told: `fived plan`'s default on GPUs (the page itself prices with
# `planned_runtime("fived", ...)`, which is this one but on CPU ranks)
DEFAULT_RUNTIME = PLANNED_RUNTIMES["fived"]


def price(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str = "bfloat16",
    headroom_gib: float = 0.0,
    runtime: Runtime = DEFAULT_RUNTIME,
) -> dict:
    """The page's entry for one layout: {"error": reason} or the planner's figures (as `fived plan`
    prices it: with the overlaps fived turns on), its flags as `run_flag_pairs`' pairs."""
    reason = layout_refusal(model, layout, seq_len, global_batch)
    if reason:
        return {"error": str(reason)}
    if runtime.is_fived:  # with every overlap fived can use, as the planner's search weighs it
        layout = with_usable_overlap(model, layout, seq_len, global_batch, fp8=runtime.fp8)
    # (fived's ZeRO-2 both ways, as the search weighs it: reducing every micro-batch where faster or it fits)
    plan = fastest_fitting(
        [
            plan_of(model, x, cluster, seq_len, global_batch, dtype, runtime, headroom_gib)
            for x in reduction_choices(layout, runtime)
        ]
    )
    assert plan is not None  # (plan_of prices every layout it is given)
    layout = plan.layout
    gib, step = plan.memory.gib(), plan.time.to_dict()
    micro = layout.microbatches(global_batch)
    return {
        "memory": [gib[k] for k in MEMORY_PARTS],
        "time": [step[k] for k in TIME_PARTS],
        "tokens_per_s_per_gpu": step["tokens_per_s_per_gpu"],
        "mfu": step["mfu"],
        "fits": plan.fits,
        "flags": run_flag_pairs(layout, global_batch, runtime),  # ("--name value" each: `run_flags` joins them)
        "describe": layout.describe(),
        "microbatches": micro,
        "bubble": pipeline_profile(layout.pp_schedule, layout.pp, layout.pp_virtual, micro)[0]
        if layout.pp > 1
        else 0.0,
        "collectives": collectives(model, layout, cluster, seq_len, global_batch, dtype),
        "map": map_keys(layout),
        "timeline": timeline_key(layout, micro),
    }


def map_keys(layout: Layout) -> list[str]:
    """Keys of the layer map's parts: weights, activations, pipeline ranks (each depends on fewer
    toggles than the whole layout: stored once per distinct key)."""
    L = layout
    return [
        f"{L.tp}|{L.ep}|{L.zero}|{L.cp}|{L.dp}|{L.dp_replicate}",
        f"{L.tp}|{L.sp}|{L.cp}|{L.micro_batch}|{L.checkpointing}",
        f"{L.pp}|{L.pp_schedule}|{L.pp_virtual}",
    ]


def timeline_key(layout: Layout, micro: int) -> str:
    if layout.pp == 1 or layout.pp > TIMELINE_MAX_PP:  # (more pipeline ranks: too many rows to read)
        return ""
    return f"{layout.pp_schedule}|{layout.pp}|{layout.pp_virtual}|{timeline_microbatches(layout, micro)}"


def timeline_microbatches(layout: Layout, micro: int) -> int:
    return min(micro, TIMELINE_MICROBATCHES * layout.pp)


@collector_paused()
def explore_data(
    model: ModelConfig,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    dtype: str = "bfloat16",
    headroom_gib: float = 0.0,
    *,
    progress: Callable[[float], None] | None = None,
    workers: int | None = None,
) -> dict:
    """Everything the explore page shows, for every reachable layout (see the module docstring);
    `progress` is told the share of the combinations done, PROGRESS_STEPS times; `workers` processes
    price them (default: one per usable core, `fived.tools.workers`), the figures the same whatever it is.
    `entries` is a flat list indexed by the toggles' value positions (`slot`: mixed radix, TOGGLES
    order): None where gpus is no multiple of tp*pp*cp, a reason's index (into `errors`), or the
    layout's figures as an array in ENTRY_FIELDS order (`entry_of` reads one), whose flags,
    collectives, map and timeline keys are indices into shared tables (`EntryTables`)."""
    options = toggle_options(model, cluster, seq_len, global_batch)
    entries: list = [None] * math.prod(len(v) for v in options.values())
    tables = EntryTables()
    drawings: dict = {part: {} for part in (*MAP_PARTS, "timeline")}  # (`EntryTables.merge`'s)
    draw = functools.partial(_drawn, model, seq_len)
    every = max(1, len(entries) // PROGRESS_STEPS)
    job = (model, cluster, seq_len, global_batch, dtype, headroom_gib, options)
    with Workers(workers) as pool:  # (each mesh priced in a worker; their figures merged here, in order)
        pending_ranking = pool.submit(ranking, model, cluster, seq_len, global_batch, dtype, headroom_gib)
        for message, priced in pool.map(priced_mesh, job, mesh_choices(options, cluster.gpus)):
            reasons, placed = tables.merge(message, drawings, draw)
            for position, entry in priced:
                if progress is not None and position // every != (position - 1) // every:
                    progress(position / len(entries))
                if isinstance(entry, int):  # reasons repeat: stored once, referenced by index
                    entries[position] = reasons[entry]
                    continue
                entries[position] = placed(entry)
        ranked = pending_ranking()
    if progress is not None:
        progress(1.0)
    hw = cluster.hardware
    return {
        "model": model.name,
        "gpus": cluster.gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "gpu": hw.name,
        "capacity_gib": hw.memory_gib - headroom_gib,
        "device_gib": hw.memory_gib,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "dtype": dtype,
        "command": train_command(f"--model {model.name}", seq_len, dtype),  # (the page adds the flags)
        "is_moe": model.is_moe,
        "n_experts": model.n_experts,
        "options": options,
        "memory_parts": MEMORY_PARTS,
        "time_parts": TIME_PARTS,
        "entries": entries,
        **tables.data(),
        "maps": {part: drawings[part] for part in MAP_PARTS},
        "timelines": drawings["timeline"],
        "ranking": ranked,
        "start": ranked[0]["values"] if ranked else least_memory(entries, options),
        "baseline": baseline(model, cluster, seq_len, global_batch, dtype, headroom_gib),
    }


def priced_mesh(job: tuple, mesh: tuple) -> tuple[Message, list[tuple[int, list | int]]]:
    """(the message's tables, [(slot, the page's entry of the layout: its ENTRY_FIELDS array, flags,
    collectives, map and timeline as indices into the message's tables; or the index of the reason it
    cannot run)]) of every combination of one of `mesh_choices` (`job`: model, cluster, seq_len,
    global_batch, dtype, headroom_gib, options). Each value that repeats is sent once and its entries
    point to it: they pickle in a fraction of the time, and the parent (`EntryTables.merge`) maps each
    distinct value once per message, not once per layout."""
    model, cluster, seq_len, global_batch, dtype, headroom_gib, options = job
    runtime = planned_runtime("fived", cluster.hardware)  # (fived plan's default, on these ranks)
    tables = MessageTables()
    out: list[tuple[int, list | int]] = []
    for position, layout in mesh_layouts(options, cluster, mesh):
        if isinstance(layout, str):
            out.append((position, tables.reasons.id(layout)))
            continue
        entry = price(model, layout, cluster, seq_len, global_batch, dtype, headroom_gib, runtime)
        if "error" in entry:
            out.append((position, tables.reasons.id(entry["error"])))
            continue
        out.append((position, tables.packed(entry, layout)))
    return tables.message(), out


def _drawn(model: ModelConfig, seq_len: int, part: str, values: tuple, micro: int):
    """What the page draws for a key of `part` (MAP_PARTS, or "timeline"), from a layout that has it:
    the layout of field values `values`, `micro` micro-batches a step."""
    layout = Layout(*values)
    if part == "weights":
        return replica_weights(model, layout)
    if part == "activations":
        return activations(model, layout, seq_len)
    if part == "ranks":
        return pipeline_ranks(model, layout)
    shown = timeline_microbatches(layout, micro)
    return {
        "microbatches": shown,
        "stages": n_stages_of(layout.pp_schedule, layout.pp, layout.pp_virtual),
        "stages_per_rank": stages_per_rank(layout.pp_schedule, layout.pp_virtual),
        "actions": schedule_timeline(layout.pp_schedule, layout.pp, layout.pp_virtual, shown),
    }


def slot(options: dict[str, list], key: str) -> int:
    """The position of a toggle key in `entries`: the values' positions, mixed radix in TOGGLES order."""
    position = 0
    for values, value in zip(options.values(), key.split("|")):
        position = position * len(values) + [str(v).lower() for v in values].index(value)
    return position


def ranking(
    model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, dtype: str, headroom_gib: float
) -> list[dict]:
    """`fived plan`'s best layouts (the same search, runtime and headroom), fastest first, each with
    the toggle values that show it."""
    runtime = planned_runtime("fived", cluster.hardware)  # (fived plan's default, on these ranks)
    search = plan(model, cluster, seq_len, global_batch, dtype, runtime, headroom_gib, keep=RANKED)
    return [
        {
            "values": toggle_values(p.layout),
            "describe": p.layout.describe(),
            "step_s": p.time.total,
            "tokens_per_s_per_gpu": p.time.tokens_per_s_per_gpu,
            "mfu": p.time.mfu,
            "gib": p.memory.gib()["total"],
        }
        for p in search.plans[:RANKED]
    ]


def least_memory(entries: list, options: dict) -> dict:
    """Where the page opens when no layout fits: the valid layout that needs the least memory."""
    total = ENTRY_FIELDS.index("memory_bytes")  # (bytes: GiB's order, the same double divided)
    valid = [(entry[total][-1], i) for i, entry in enumerate(entries) if isinstance(entry, list)]
    position = min(valid)[1] if valid else 0
    values = {}
    for name, choices in reversed(list(options.items())):  # (slot's mixed radix, undone)
        position, i = divmod(position, len(choices))
        values[name] = str(choices[i]).lower()
    return {name: values[name] for name in options}


def baseline(
    model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, dtype: str, headroom_gib: float
) -> list[float]:
    """No parallelism: the whole model and one sequence's activations on one GPU (the planner's
    memory for dp=1, every other dimension 1, ZeRO-0)."""
    from fived.planner.memory import memory_per_gpu

    gib = memory_per_gpu(model, Layout(), seq_len, 1, dtype, cluster.hardware.memory_gib).gib()
    return [gib[k] for k in MEMORY_PARTS]


def layout_from_flags(model: ModelConfig, flags: str, gpus: int, seq_len: int, global_batch: int) -> Layout:
    """The layout `fived train`'s layout flags give ("--tp 4 --sp --zero 1", or "--parallel.tp 4
    --train.microbatches 8 ..." as `Layout.flags` prints them), for `fived plan --layout`."""
    import argparse
    import shlex

    from fived.launch.run_setup import LaunchRequest, add_config_flags, build_from_args, overrides_of

    parser = argparse.ArgumentParser(
        prog="fived plan --layout", add_help=False, allow_abbrev=False, exit_on_error=False
    )
    add_config_flags(parser)
    example = "e.g. --layout '--tp 4 --sp --pp 2 --zero 1' (fived train's flags)"
    try:
        ns, unknown = parser.parse_known_args(shlex.split(flags))
    except (argparse.ArgumentError, ValueError) as e:
        raise ConfigError("--layout", flags, f"not fived train's flags ({e})", example) from None
    if unknown:
        raise ConfigError("--layout", flags, f"{unknown[0]} is not one of fived train's flags", example)
    overrides = {"train.global_batch": global_batch, **overrides_of(ns), "train.seq_len": seq_len}
    cfg = build_from_args(LaunchRequest(overrides=overrides, dp_shard=ns.dp_shard))
    cfg.model = model
    layout = Layout.from_config(cfg, gpus)
    reason = layout_refusal(model, layout, seq_len, global_batch)
    if reason:
        raise reason
    return layout
