"""`fived explore`: the planner's figures for every layout the page's toggles can reach, as one JSON
document the page (`fived.pages`) only looks values up in.

The toggles (OPTIONS) span tp (+sp), cp, pp (+schedule, virtual stages), ep, ZeRO stage, micro-batch
size and activation checkpointing; dp is what the GPU count leaves (gpus / (tp*pp*cp)). Each reachable
combination is either priced by the planner (`fived.planner.search.evaluate`: memory per GPU, step
time, the collectives of `fived.planner.communication` with the links `fived.planner.timing` puts them
on, the flags that run it) or refused with the runtime's own one-line reason
(`fived.layout.rules.layout_errors`, then torch's schedule rules). The layer map's local shapes come
from `fived.planner.layer_map`, the pipeline timeline from `fived.layout.schedule_sim`.
"""
from __future__ import annotations

import functools
import itertools

from fived.config import ConfigError, ModelConfig
from fived.layout.layout import Layout, stages_per_rank
from fived.layout.schedule_sim import n_stages_of, pipeline_profile, schedule_timeline
from fived.planner.communication import group_span, step_collectives
from fived.planner.layer_map import activations, pipeline_ranks, replica_weights
from fived.layout.stages import rank_chunks, rank_stages
from fived.planner.runtimes import PLANNED_RUNTIMES, Runtime
from fived.planner.search import evaluate, layout_refusal
from fived.planner.timing import Cluster, in_node

OPTIONS = {
    "tp": [1, 2, 4, 8], "sp": [False, True], "cp": [1, 2], "pp": [1, 2, 4, 8],
    "pp_schedule": ["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"],
    "pp_virtual": [1, 2], "ep": [1, 2, 4, 8], "zero": [0, 1, 2, 3], "micro_batch": [1, 2],
    "checkpointing": ["none", "selective", "full"],
}
DENSE_EP = [1, 2]  # a dense model's ep toggle: 2 shows the runtime's refusal
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "reserve", "total")
TIME_PARTS = ("compute", "bubble", "tp", "cp", "ep", "pp", "dp", "optimizer", "overhead", "total")
TIMELINE_MICROBATCHES = 4  # per pipeline rank drawn: enough to show fill, steady state and drain


def layout_key(layout: Layout) -> str:
    """The page's lookup key: the toggles' values in OPTIONS order (what the page's script builds)."""
    return "|".join(str(getattr(layout, name)).lower() for name in OPTIONS)


def reachable_layouts(model: ModelConfig, gpus: int):
    """Every combination of the toggles whose model-parallel size divides the GPU count (dp the rest);
    schedule and virtual stages only vary with pp > 1."""
    eps = OPTIONS["ep"] if model.is_moe else DENSE_EP
    for tp, sp, cp, pp in itertools.product(OPTIONS["tp"], OPTIONS["sp"], OPTIONS["cp"], OPTIONS["pp"]):
        if gpus % (tp * cp * pp):
            continue
        schedules = itertools.product(OPTIONS["pp_schedule"], OPTIONS["pp_virtual"]) if pp > 1 else [("1f1b", 1)]
        for (schedule, virtual), ep, zero, mbs, ac in itertools.product(
                schedules, eps, OPTIONS["zero"], OPTIONS["micro_batch"], OPTIONS["checkpointing"]):
            yield Layout(dp=gpus // (tp * cp * pp), tp=tp, sp=sp, cp=cp, pp=pp, pp_schedule=schedule,
                         pp_virtual=virtual, ep=ep, zero=zero, micro_batch=mbs, checkpointing=ac)


def collectives(model: ModelConfig, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int,
                dtype: str) -> list[list]:
    """[group, op, bytes per step, calls per step, link] of pipeline rank 0 (the planner's list)."""
    chunks = rank_chunks(model, layout, 0)
    merged: dict = {}
    for c in step_collectives(model, layout, seq_len, global_batch, dtype, chunks, rank_stages(layout, 0)):
        if not c.part or c.total == 0:
            continue
        total, calls = merged.get((c.group, c.op), (0.0, 0.0))
        merged[(c.group, c.op)] = (total + c.total, calls + c.calls)
    out = []
    for (group, op), (total, calls) in merged.items():
        size, stride = group_span(layout, group)
        if size == 1:
            continue
        link = "NVLink" if in_node(cluster.gpus_per_node, stride, size) else "network"
        members, others = replica_members(layout.with_(micro_batch=1, checkpointing="none", sp=False), group)
        out.append([group, op, round(total), round(calls, 3), link, size, members, others])
    return out


@functools.lru_cache(maxsize=4096)
def replica_members(layout: Layout, group: str) -> tuple[list[int], int]:
    """(global ranks of rank 0's `group` inside the first model replica, how many lie outside it): the
    replica is the pp x cp x tp ranks whose data-parallel index is 0 (`Layout.group_ranks`' mesh)."""
    ranks = layout.group_ranks(group, 0)
    inside = sorted(r for r in ranks if r // (layout.tp * layout.cp) % layout.dp == 0)
    return inside, len(ranks) - len(inside)


# the runtime the page prices, as `fived plan` (and `fived plan --layout`) does by default
DEFAULT_RUNTIME = PLANNED_RUNTIMES["fived"]


def price(model: ModelConfig, layout: Layout, cluster: Cluster, seq_len: int, global_batch: int,
          dtype: str = "bfloat16", headroom_gib: float = 0.0, runtime: Runtime = DEFAULT_RUNTIME) -> dict:
    """The page's entry for one layout: {"error": reason} or the planner's figures."""
    reason = layout_refusal(model, layout, seq_len, global_batch)
    if reason:
        return {"error": str(reason)}
    plan = evaluate(model, layout, cluster, seq_len, global_batch, dtype, runtime, headroom_gib, checked=True)
    gib, step = plan.memory.gib(), plan.time.to_dict()
    micro = layout.microbatches(global_batch)
    return {"memory": [gib[k] for k in MEMORY_PARTS], "time": [step[k] for k in TIME_PARTS],
            "tokens_per_s_per_gpu": step["tokens_per_s_per_gpu"], "mfu": step["mfu"], "fits": plan.fits,
            "flags": layout.flags(global_batch), "describe": layout.describe(), "microbatches": micro,
            "bubble": pipeline_profile(layout.pp_schedule, layout.pp, layout.pp_virtual, micro)[0] if layout.pp > 1 else 0.0,
            "collectives": collectives(model, layout, cluster, seq_len, global_batch, dtype),
            "map": map_keys(layout), "timeline": timeline_key(layout, micro)}


def map_keys(layout: Layout) -> list[str]:
    """Keys of the layer map's parts: weights, activations, pipeline ranks (each depends on fewer
    toggles than the whole layout: stored once per distinct key)."""
    L = layout
    return [f"{L.tp}|{L.ep}|{L.zero}|{L.cp}|{L.dp}", f"{L.tp}|{L.sp}|{L.cp}|{L.micro_batch}|{L.checkpointing}",
            f"{L.pp}|{L.pp_schedule}|{L.pp_virtual}"]


def timeline_key(layout: Layout, micro: int) -> str:
    if layout.pp == 1:
        return ""
    return f"{layout.pp_schedule}|{layout.pp}|{layout.pp_virtual}|{timeline_microbatches(layout, micro)}"


def timeline_microbatches(layout: Layout, micro: int) -> int:
    return min(micro, TIMELINE_MICROBATCHES * layout.pp)


def explore_data(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, dtype: str = "bfloat16",
                 headroom_gib: float = 0.0) -> dict:
    """Everything the explore page shows, for every reachable layout (see the module docstring)."""
    entries, errors, timelines = {}, [], {}
    maps: dict = {"weights": {}, "activations": {}, "ranks": {}}
    for layout in reachable_layouts(model, cluster.gpus):
        entry = price(model, layout, cluster, seq_len, global_batch, dtype, headroom_gib)
        if "error" in entry:  # reasons repeat: stored once, referenced by index
            if entry["error"] not in errors:
                errors.append(entry["error"])
            entries[layout_key(layout)] = errors.index(entry["error"])
            continue
        for part, key in zip(("weights", "activations", "ranks"), entry["map"]):
            if key not in maps[part]:
                maps[part][key] = (replica_weights(model, layout) if part == "weights" else
                                   activations(model, layout, seq_len) if part == "activations" else
                                   pipeline_ranks(model, layout))
        if entry["timeline"] and entry["timeline"] not in timelines:
            shown = timeline_microbatches(layout, entry["microbatches"])
            timelines[entry["timeline"]] = {
                "microbatches": shown, "stages": n_stages_of(layout.pp_schedule, layout.pp, layout.pp_virtual),
                "stages_per_rank": stages_per_rank(layout.pp_schedule, layout.pp_virtual),
                "actions": schedule_timeline(layout.pp_schedule, layout.pp, layout.pp_virtual, shown)}
        entries[layout_key(layout)] = entry
    hw = cluster.hardware
    return {"model": model.name, "gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node, "gpu": hw.name,
            "capacity_gib": hw.memory_gib - headroom_gib, "device_gib": hw.memory_gib, "seq_len": seq_len,
            "global_batch": global_batch, "dtype": dtype, "is_moe": model.is_moe, "n_experts": model.n_experts,
            "options": {**OPTIONS, "ep": OPTIONS["ep"] if model.is_moe else DENSE_EP},
            "memory_parts": MEMORY_PARTS, "time_parts": TIME_PARTS, "errors": errors, "entries": entries,
            "maps": maps, "timelines": timelines,
            "baseline": baseline(model, cluster, seq_len, global_batch, dtype, headroom_gib)}


def baseline(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, dtype: str,
             headroom_gib: float) -> list[float]:
    """No parallelism: the whole model and one sequence's activations on one GPU (the planner's
    memory for dp=1, every other dimension 1, ZeRO-0)."""
    from fived.planner.memory import memory_per_gpu

    gib = memory_per_gpu(model, Layout(), seq_len, 1, dtype, cluster.hardware.memory_gib).gib()
    return [gib[k] for k in MEMORY_PARTS]


def layout_from_flags(model: ModelConfig, flags: str, gpus: int, seq_len: int, global_batch: int) -> Layout:
    """The layout `fived train`'s layout flags give ("--parallel.tp 4 --train.microbatches 8 ...", as
    `Layout.flags` prints them), for `fived plan --layout`."""
    import shlex

    from fived.config import build_config

    words = shlex.split(flags)
    if len(words) % 2 or any(not w.startswith("--") for w in words[::2]):
        raise ConfigError("--layout", flags, "must be pairs of --section.field value",
                          "e.g. --layout '--parallel.tp 4 --parallel.zero 3'")
    overrides = {k[2:]: v for k, v in zip(words[::2], words[1::2])}
    overrides.setdefault("train.global_batch", global_batch)
    cfg = build_config(overrides={**overrides, "train.seq_len": seq_len})
    cfg.model = model
    layout = Layout.from_config(cfg, gpus)
    reason = layout_refusal(model, layout, seq_len, global_batch)
    if reason:
        raise reason
    return layout
