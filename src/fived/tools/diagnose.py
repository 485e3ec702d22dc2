"""`fived diagnose RUN_DIR`: why a run is slow, from what it measured (run.json's step breakdown).

Prints where the step time goes (measured vs the planner's prediction, per component), the failure
modes present — each with its measured evidence and the threshold it crossed — and the layouts the
planner would try next with their predicted gain, as `fived train` flags. The last line is
`failure modes: <names>` or `failure modes: none`.

The failure modes (thresholds: shares of the measured step time, the mean over ranks):
  too-much-tp              tp collectives exposed >= 25% of the step (the model fits; tp costs more than it saves)
  pipeline-imbalance       the busiest pipeline rank computes >= 1.25x the mean pipeline rank
  too-few-microbatches     the pipeline waits >= 20% of the step and its schedule's ideal bubble
                           with this many micro-batches is >= 25%
  too-many-microbatches    >= 4 micro-batches per pipeline stage and the pipeline waits >= 10 points
                           of the step more than its schedule's ideal bubble (per-micro-batch costs:
                           P2P latency and scheduling grow with their number; activations too)
  expert-all-to-all        ep all-to-all exposed >= 20% of the step (MoE's savings erased)
  expert-imbalance         the most loaded expert gets >= 3x the mean tokens (worst MoE layer)
  cp-communication-exposed the context-parallel ring's waits >= 15% of the step (not hidden behind attention)
  recompute-on-critical-path  activation recomputation >= 10% of the step in a pipeline (every
                           stage's backward grows by it, and the bubble with it)
  uneven-microbatches      the slowest micro-batch computes >= 1.5x the fastest (uneven sequence lengths or load)
  cp-imbalance             with document masking, the busiest cp rank's attention work (the (query, key) pairs
                           its tokens attend to, fived.data.documents) >= 1.25x the mean (median over the logged steps)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from fived.config import Config, ConfigError, config_from_dict
from fived.files import read_json, read_json_lines
from fived.layout.layout import Layout, stages_per_rank
from fived.training.breakdown import COMPARED, compared

TP_SHARE = 0.25
STAGE_RATIO = 1.25
BUBBLE_SHARE, IDEAL_BUBBLE = 0.20, 0.25
MICRO_PER_STAGE, EXCESS_BUBBLE = 4, 0.10
EP_SHARE = 0.20
EXPERT_RATIO = 3.0
CP_SHARE = 0.15
RECOMPUTE_SHARE = 0.10
MICRO_RATIO = 1.5
CP_WORK_RATIO = 1.25


@dataclass
class Finding:
    name: str
    evidence: str  # the measured figures
    threshold: str  # the rule they crossed
    advice: str


@dataclass
class Measured:
    """The run's figures the rules read: mean components over ranks, per pipeline rank compute."""

    total: float
    parts: dict[str, float]  # the planner's terms (fived.training.breakdown.compared), mean over ranks
    raw: dict[str, float]  # the measured components, mean over ranks
    pp_compute: dict[int, list[float]]  # pipeline rank -> compute seconds of each rank there
    micro: list[list[float]]  # each micro-batch's compute seconds, per (rank, pipeline stage)

    def share(self, seconds: float) -> float:
        return seconds / self.total if self.total else 0.0


def read_run(run_dir: str) -> tuple[dict, Config]:
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise ConfigError(
            "run_dir",
            run_dir,
            "has no run.json (written when `fived train` ends)",
            "give a finished run's directory, e.g. runs/default",
        )
    run = read_json(path) or {}  # (a torn run.json: one warning, then "no breakdown")
    if "breakdown" not in run or "config" not in run or not any(run["breakdown"]["ranks"]):
        raise ConfigError(
            "run_dir",
            run_dir,
            "has no measured step breakdown in run.json",
            "train it again with this fived (train.breakdown=true, the default)",
        )
    return run, config_from_dict(run["config"])


def measure(run: dict, cfg, world: int) -> Measured:
    ranks = [r for r in run["breakdown"]["ranks"] if r]
    n = len(ranks)
    per_rank = [compared(r) for r in ranks]
    parts = {k: sum(c[k] for c in per_rank) / n for k in COMPARED}
    raw: dict[str, float] = {}
    for r in ranks:
        for k, v in r["components"].items():
            raw[k] = raw.get(k, 0.0) + v / n
    layout = Layout.from_config(cfg, world)
    pp_compute: dict[int, list[float]] = {}
    for rank, r in enumerate(run["breakdown"]["ranks"]):
        if r:
            pp_compute.setdefault(layout.coordinates(rank)["pp"], []).append(sum(r["stage_compute_s"].values()))
    micro = [stage for r in ranks for stage in r["microbatch_s"] if len(stage) > 1]
    return Measured(sum(r["total_s"] for r in ranks) / n, parts, raw, pp_compute, micro)


def ideal_bubble(cfg) -> float:
    from fived.layout.schedule_sim import pipeline_profile

    p = cfg.parallel
    return pipeline_profile(p.pp_schedule, p.pp, p.pp_virtual, cfg.train.microbatches)[0] if p.pp > 1 else 0.0


def findings(m: Measured, cfg, run: dict) -> list[Finding]:
    rules = (
        _too_much_tp,
        _pipeline_imbalance,
        _too_few_micro,
        _too_many_micro,
        _expert_all_to_all,
        _expert_imbalance,
        _cp_exposed,
        _recompute,
        _uneven_micro,
        _cp_imbalance,
    )
    found = [rule(m, cfg, run) for rule in rules]
    return [f for f in found if f is not None]


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _exposed(m: Measured, name: str, dim: str, size: int, threshold: float, what: str, advice: str) -> Finding | None:
    """A mesh dimension whose exposed communication (`what`) takes `threshold` of the step or more."""
    share = m.share(m.parts[dim])
    if size == 1 or share < threshold:
        return None
    return Finding(
        name,
        f"{what} took {m.parts[dim]:.4f} s of the {m.total:.4f} s step ({_pct(share)}) at {dim}={size}",
        f">= {_pct(threshold)} of the step",
        advice,
    )


def _too_much_tp(m: Measured, cfg, run) -> Finding | None:
    tp = cfg.parallel.tp
    return _exposed(
        m,
        "too-much-tp",
        "tp",
        tp,
        TP_SHARE,
        "exposed tp collectives",
        f"use less tensor parallelism (e.g. --tp {tp // 2}) and more data parallelism",
    )


def _pp_ranks(m: Measured) -> dict[int, float]:
    return {pp: sum(v) / len(v) for pp, v in m.pp_compute.items()}


def _pipeline_imbalance(m: Measured, cfg, run) -> Finding | None:
    if cfg.parallel.pp == 1:
        return None
    per = _pp_ranks(m)
    mean = sum(per.values()) / len(per)
    busiest = max(per, key=lambda pp: per[pp])
    ratio = per[busiest] / mean if mean else 1.0
    if ratio < STAGE_RATIO:
        return None
    split = ",".join(str(v) for v in (f"{p:.4f}" for _, p in sorted(per.items())))
    return Finding(
        "pipeline-imbalance",
        f"pipeline rank {busiest} computes {per[busiest]:.4f} s per step, "
        f"{ratio:.2f}x the mean pipeline rank ({mean:.4f} s; per rank {split} s)",
        f">= {STAGE_RATIO}x the mean",
        "balance the stages: drop --parallel.pp_layers (split by cost) or move layers off the busiest stage",
    )


def _too_few_micro(m: Measured, cfg, run) -> Finding | None:
    if cfg.parallel.pp == 1:
        return None
    share, ideal = m.share(m.parts["bubble"]), ideal_bubble(cfg)
    if share < BUBBLE_SHARE or ideal < IDEAL_BUBBLE:
        return None
    micro, local = cfg.train.microbatches, _local_batch(cfg, run)
    want = max(micro * 4, 4 * cfg.parallel.pp)
    more = _micro_batches_near(local, want)
    advice = f"more micro-batches per step, e.g. --train.microbatches {more}"
    if more <= micro:  # every micro-batch is one sequence already: a larger batch per step
        advice = (
            f"more micro-batches need a larger batch, e.g. --train.global_batch "
            f"{cfg.train.global_batch * want // micro} --train.microbatches {want}"
        )
    return Finding(
        "too-few-microbatches",
        f"the pipeline waited {_pct(share)} of the step; "
        f"{cfg.parallel.pp_schedule} with {micro} micro-batch(es) over pp={cfg.parallel.pp} idles "
        f"{_pct(ideal)} by design",
        f"waiting >= {_pct(BUBBLE_SHARE)} and ideal bubble >= {_pct(IDEAL_BUBBLE)}",
        advice,
    )


def _local_batch(cfg, run: dict) -> int:
    """Sequences per data-parallel rank and step."""
    return cfg.train.global_batch // max(1, run.get("layout", {}).get("dp", 1))


def _micro_batches_near(local: int, want: int) -> int:
    """The micro-batch count nearest `want` that divides a local batch of `local` sequences (a valid
    --train.microbatches; the larger on a tie)."""
    return min((d for d in range(1, local + 1) if local % d == 0), key=lambda d: (abs(d - want), -d))


def _too_many_micro(m: Measured, cfg, run) -> Finding | None:
    p = cfg.parallel
    stages = p.pp * stages_per_rank(p.pp_schedule, p.pp_virtual)
    if p.pp == 1 or cfg.train.microbatches < MICRO_PER_STAGE * stages or _pipeline_imbalance(m, cfg, run):
        return None
    share, ideal = m.share(m.parts["bubble"]), ideal_bubble(cfg)
    if share - ideal < EXCESS_BUBBLE:
        return None
    tokens = _local_batch(cfg, run) * cfg.train.seq_len // cfg.train.microbatches
    return Finding(
        "too-many-microbatches",
        f"{cfg.train.microbatches} micro-batches of {tokens} tokens: the "
        f"pipeline waited {_pct(share)} of the step where {p.pp_schedule}'s ideal bubble is {_pct(ideal)}",
        f">= {MICRO_PER_STAGE} micro-batches per stage and waiting >= {_pct(EXCESS_BUBBLE)} above ideal",
        "fewer, larger micro-batches, e.g. --train.microbatches "
        f"{_micro_batches_near(_local_batch(cfg, run), max(2 * stages, cfg.train.microbatches // 4))}",
    )


def _expert_all_to_all(m: Measured, cfg, run) -> Finding | None:
    ep = cfg.parallel.ep
    return _exposed(
        m,
        "expert-all-to-all",
        "ep",
        ep,
        EP_SHARE,
        "the experts' all-to-all",
        f"fewer expert-parallel ranks (e.g. --ep {ep // 2}), or ep within a node",
    )


def _expert_imbalance(m: Measured, cfg, run) -> Finding | None:
    loads = run.get("expert_load", {})
    worst = None
    for layer, row in loads.items():
        mean = sum(row) / len(row) if row else 0.0
        if mean > 0 and (worst is None or max(row) / mean > worst[1]):
            worst = (layer, max(row) / mean, row)
    if worst is None or worst[1] < EXPERT_RATIO:
        return None
    layer, ratio, row = worst
    top = max(range(len(row)), key=row.__getitem__)
    ep = cfg.parallel.ep
    per_rank = ""
    if ep > 1:
        ranks = _tokens_per_ep_rank({layer: row}, ep)[layer]
        per_rank = f"; tokens per ep rank {', '.join(f'{t:.0f}' for t in ranks)}"
    return Finding(
        "expert-imbalance",
        f"layer {layer}: expert {top} got {row[top]:.0f} tokens, {ratio:.1f}x the mean "
        f"{sum(row) / len(row):.0f}{per_rank}",
        f">= {EXPERT_RATIO}x the mean",
        "balance the router: --model.router_bias_rate 1e-3 (aux-loss-free) or a larger --model.aux_loss_coef",
    )


def _cp_exposed(m: Measured, cfg, run) -> Finding | None:
    cp = cfg.parallel.cp
    return _exposed(
        m,
        "cp-communication-exposed",
        "cp",
        cp,
        CP_SHARE,
        "waiting for the cp ring",
        f"longer sequences per rank hide the ring: fewer cp ranks (e.g. --cp {cp // 2})",
    )


def _cp_imbalance(m: Measured, cfg, run) -> Finding | None:
    spread = run.get("cp_work_spread")
    if spread is None or spread < CP_WORK_RATIO:
        return None
    advice = (
        "balance the chunks by work: --parallel.cp_balance work"
        if cfg.parallel.cp_balance == "halves"
        else "a longer sequence per cp rank (fewer cp ranks) gives the balance finer chunks"
    )
    return Finding(
        "cp-imbalance",
        f"the busiest cp rank's attention work is {spread:.2f}x the mean (document masking, "
        f"cp_balance={cfg.parallel.cp_balance})",
        f">= {CP_WORK_RATIO}x the mean",
        advice,
    )


def cp_work_spread(run_dir: str, *, warn_torn: bool = True) -> float | None:
    """The median over metrics.jsonl's steps of the cp work spread (None without one)."""
    import statistics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    values = [r["cp_work_spread"] for r in read_json_lines(path, warn=warn_torn) if "cp_work_spread" in r]
    return statistics.median(values) if values else None


def _recompute(m: Measured, cfg, run) -> Finding | None:
    seconds = m.raw.get("recompute", 0.0)
    share = m.share(seconds)
    if cfg.parallel.pp == 1 or share < RECOMPUTE_SHARE:
        return None
    mode = cfg.train.activation_checkpointing
    return Finding(
        "recompute-on-critical-path",
        f"{mode} checkpointing recomputed for {seconds:.4f} s of the "
        f"{m.total:.4f} s step ({_pct(share)}) on every pipeline stage",
        f">= {_pct(RECOMPUTE_SHARE)} of the step in a pipeline",
        "recompute less: --train.activation_checkpointing selective (or none where memory allows)",
    )


def _spread(series: list[float]) -> float:
    return max(series) / min(series) if series and min(series) > 0 else 1.0


def _uneven_micro(m: Measured, cfg, run) -> Finding | None:
    """The micro-batches one rank computes for one stage, slowest against fastest."""
    worst = max(m.micro, key=_spread, default=None)
    if worst is None or _spread(worst) < MICRO_RATIO:
        return None
    return Finding(
        "uneven-microbatches",
        f"micro-batch compute ranges {min(worst):.4f}..{max(worst):.4f} s ({_spread(worst):.2f}x)",
        f">= {MICRO_RATIO}x",
        "even the work per micro-batch (pack sequences to equal length)",
    )


def suggestions(cfg, world: int, run: dict, run_dir: str, limit: int = 3) -> list[dict]:
    """The planner's fastest fitting layouts other than this run's, with their predicted gain over
    this layout's predicted step, as the `fived train` command that runs each (this run's config,
    the layout's flags)."""
    from fived.layout.layout import Layout
    from fived.planner.hardware import Hardware
    from fived.planner.runtimes import train_runtime
    from fived.planner.search import plan
    from fived.planner.timing import Cluster

    described = run["breakdown"].get("hardware")
    predicted = run["breakdown"].get("predicted")
    if not described or not predicted:
        return []
    cluster = Cluster(Hardware(**described), world, world)
    current = Layout.from_config(cfg, world)
    here = sum(predicted.values())
    out = []
    for candidate in plan(
        cfg.model,
        cluster,
        cfg.train.seq_len,
        cfg.train.global_batch,
        cfg.train.dtype,
        train_runtime(cfg.train, gpu=cluster.hardware.calibration != "cpu"),
    ).plans:
        if candidate.layout == current or not candidate.layout.runnable:
            continue
        total = candidate.time.total
        out.append(
            {
                "describe": candidate.layout.describe(),
                "predicted_s": total,
                "gain": here / total,
                "command": f"fived train --config {run_dir}/config.toml --nproc {world} "
                f"--train.output_dir {run_dir.rstrip('/')}-next " + candidate.layout.flags(cfg.train.global_batch),
            }
        )
        if len(out) == limit:
            break
    return out


def _tokens_per_ep_rank(loads: dict[str, list[float]], ep: int) -> dict[str, list[float]]:
    """MoE layer -> the tokens each expert-parallel rank's experts received (last step)."""
    out = {}
    for layer, row in loads.items():
        local = len(row) // ep
        out[layer] = [sum(row[r * local : (r + 1) * local]) for r in range(ep)]
    return out


def diagnose(run_dir: str, *, warn_torn: bool = True) -> dict:
    """Everything `fived diagnose` says, as data (`--json`). `warn_torn=False`: the caller (the report
    page) has read metrics.jsonl already and warned of its torn lines."""
    run, cfg = read_run(run_dir)
    run["cp_work_spread"] = cp_work_spread(run_dir, warn_torn=warn_torn)
    world = run["world"]
    m = measure(run, cfg, world)
    predicted = run["breakdown"].get("predicted", {})
    rows = [
        {
            "component": k,
            "measured_s": m.parts[k],
            "measured_share": m.share(m.parts[k]),
            "predicted_s": predicted.get(k),
        }
        for k in COMPARED
    ]
    overlapped: dict[str, float] = {}
    ranks = [r for r in run["breakdown"]["ranks"] if r]
    for r in ranks:
        for dim, s in r.get("overlapped", {}).items():
            overlapped[dim] = overlapped.get(dim, 0.0) + s / len(ranks)
    found = findings(m, cfg, run)
    return {
        "run_dir": run_dir,
        "layout": run.get("layout", {}),
        "world": world,
        "step_s": m.total,
        "predicted_step_s": sum(predicted.values()) if predicted else None,
        "components": rows,
        "overlapped": overlapped,
        "pipeline_ranks": {str(k): v for k, v in _pp_ranks(m).items()},
        # imbalance: per pipeline rank, its slowest data/tensor-parallel rank over their mean
        "rank_spread": {str(pp): max(v) / (sum(v) / len(v)) for pp, v in m.pp_compute.items() if sum(v) > 0},
        "microbatch_spread": max((_spread(s) for s in m.micro), default=1.0),
        "cp_work_spread": run["cp_work_spread"],
        "expert_tokens_per_ep_rank": _tokens_per_ep_rank(run.get("expert_load", {}), cfg.parallel.ep)
        if cfg.parallel.ep > 1
        else {},
        "findings": [asdict(f) for f in found],
        "next_layouts": suggestions(cfg, world, run, run_dir),
        "failure_modes": [f.name for f in found],
    }


def format_diagnosis(d: dict) -> str:
    lines = [
        f"fived diagnose {d['run_dir']}: {d['world']} rank(s), layout "
        + " ".join(f"{k}={d['layout'][k]}" for k in ("dp", "tp", "pp", "cp", "ep", "zero") if k in d["layout"])
    ]
    predicted = d["predicted_step_s"]
    lines.append(
        f"step time {d['step_s']:.4f} s measured (mean over ranks, steps after the first)"
        + (f", {predicted:.4f} s predicted by the planner" if predicted else "")
    )
    lines.append("where it goes        measured          predicted")
    for row in d["components"]:
        pred = "" if row["predicted_s"] is None else f"{row['predicted_s']:.4f} s"
        lines.append(f"  {row['component']:<12} {row['measured_s']:.4f} s {row['measured_share']:>4.0%}   {pred}")
    if d["overlapped"]:
        lines.append(
            "  overlapped under compute (not in the step): "
            + ", ".join(f"{dim} {s:.4f} s" for dim, s in sorted(d["overlapped"].items()))
        )
    if len(d["pipeline_ranks"]) > 1:
        lines.append(
            "  compute per pipeline rank: " + ", ".join(f"pp{k} {v:.4f} s" for k, v in d["pipeline_ranks"].items())
        )
    if d["world"] > 1:
        lines.append(
            "  slowest rank / mean, per pipeline rank: "
            + ", ".join(f"pp{k} {v:.2f}x" for k, v in d["rank_spread"].items())
        )
    lines.append(f"  micro-batches: slowest / fastest {d['microbatch_spread']:.2f}x (one rank's, one stage's)")
    if d["cp_work_spread"] is not None:
        lines.append(f"  attention work, busiest cp rank / mean: {d['cp_work_spread']:.2f}x (document masking)")
    ranks = d["expert_tokens_per_ep_rank"]
    if ranks:  # the worst MoE layer's tokens per expert-parallel rank
        layer = max(ranks, key=lambda k: max(ranks[k]) / max(sum(ranks[k]) / len(ranks[k]), 1e-9))
        lines.append(
            f"  tokens per ep rank, most uneven layer ({layer}): " + ", ".join(f"{t:.0f}" for t in ranks[layer])
        )
    for f in d["findings"]:
        lines.append(f"{f['name']}: {f['evidence']} (threshold {f['threshold']}); {f['advice']}")
    if d["next_layouts"]:
        lines.append("the planner would try next:")
        for s in d["next_layouts"]:
            lines.append(
                f"  {s['describe']}: predicted {s['predicted_s']:.4f} s/step ({s['gain']:.2f}x this layout's "
                f"prediction)\n    {s['command']}"
            )
    lines.append("failure modes: " + (", ".join(d["failure_modes"]) or "none"))
    return "\n".join(lines)
