"""`fived calibrate`'s measurements on forked ranks: the collectives over every group size, and the
host time of fived's trainer at negligible shapes.

Collectives: for a group size g, the ranks split into groups of g consecutive ranks (what ranks are
left over wait), and every group runs the same collective at once, as a layout's groups do. Every
rank times each call; a point is the slowest rank's mean (fived.tools.calibrate says why the mean). The repetitions are agreed on by all
ranks (an all-reduce of the warm-up's time) so that no rank waits on a collective another skipped.
Send/recv: pairs exchange the tensor both ways; a send is half the round trip.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from fived.launch.ranks import run_ranks

OPS = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "send")
MAX_CALLS = 100


def _call(op: str, group, size: int, x: torch.Tensor, out: torch.Tensor, rank_in_group: int):
    """One collective call (the ledger's bytes: x for all-reduce, all-to-all, send and a reduce-scatter's
    input; out, the same size, for an all-gather's output)."""
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "all_gather_single":
        dist.all_gather_single(out, x[: x.numel() // size], group=group)
    elif op == "reduce_scatter_single":
        dist.reduce_scatter_single(out[: x.numel() // size], x, group=group)
    elif op == "all_to_all_single":
        dist.all_to_all_single(out, x, group=group)
    else:  # send: there and back between the pair, timed as two sends
        peer = dist.get_global_rank(group, 1 - rank_in_group)
        if rank_in_group == 0:
            dist.send(x, peer)
            dist.recv(out, peer)
        else:
            dist.recv(out, peer)
            dist.send(x, peer)


def _calls(seconds: float, slice_s: float) -> int:
    """Calls every rank makes: the warm-up's slowest time fills the slice (3 to MAX_CALLS)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(min(MAX_CALLS, max(3, slice_s / max(t.item(), 1e-6))))


def _point(op: str, group, size: int, nbytes: int, slice_s: float, device) -> float:
    """This rank's mean seconds per call (nan if it is in no group)."""
    numel = max(size, nbytes // 4 // size * size)
    x, out = torch.ones(numel, device=device), torch.empty(numel, device=device)
    me = dist.get_group_rank(group, dist.get_rank()) if group is not None else -1
    start = time.perf_counter()
    if group is not None:
        _call(op, group, size, x, out, me)
    calls = _calls(time.perf_counter() - start, slice_s)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        if group is not None:
            _call(op, group, size, x, out, me)
        times.append(time.perf_counter() - start)
    dist.barrier()
    if group is None:
        return float("nan")
    return statistics.fmean(times) / (2 if op == "send" else 1)


def _my_group(size: int):
    """Every rank creates every group of `size` consecutive ranks (new_group is collective); returns
    this rank's, or None for a rank left over."""
    world, rank, mine = dist.get_world_size(), dist.get_rank(), None
    for first in range(0, world - size + 1, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return mine


def _rank_collectives(message_bytes: tuple[int, ...], slice_s: float) -> list:
    """[op, group size, bytes, seconds] for every point (nan where this rank sat out)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    out = []
    for size in range(2, dist.get_world_size() + 1):
        group = _my_group(size)
        for op in OPS:
            if op == "send" and size != 2:  # (a send joins two ranks: the pairs of group size 2)
                continue
            for nbytes in message_bytes:
                out.append([op, size, nbytes, _point(op, group, size, nbytes, slice_s, device)])
    return out


def fit_curve(points: list[tuple[int, float]]) -> dict:
    """The measured seconds by bytes and the least-squares line latency + bytes / bandwidth through them."""
    xs, ys = [float(b) for b, _ in points], [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 0:  # (flat within noise: the largest message's own rate)
        slope = ys[-1] / xs[-1]
    return {"bytes": xs, "seconds": ys, "latency_s": max(0.0, my - slope * mx), "bytes_per_s": 1 / slope}


def measure_collectives(nproc: int, message_bytes: tuple[int, ...], budget_s: float) -> tuple[list, dict]:
    """(raw [op, group size, bytes, seconds] rows, {op: {group size: curve}}) on `nproc` fresh ranks."""
    points = sum(len(message_bytes) * (len(OPS) - 1 if g > 2 else len(OPS)) for g in range(2, nproc + 1))
    per_rank = run_ranks(nproc, _rank_collectives, message_bytes, budget_s / points, timeout_s=120.0)
    raw = []
    for i, (op, size, nbytes, _) in enumerate(per_rank[0]):
        seconds = max(r[i][3] for r in per_rank if r[i][3] == r[i][3])  # the slowest rank that took part
        raw.append([op, size, nbytes, seconds])
    fitted: dict[str, dict[str, dict]] = {}
    for op in OPS:
        for size in sorted({row[1] for row in raw if row[0] == op}):
            rows = [(b, s) for o, g, b, s in raw if o == op and g == size]
            fitted.setdefault(op, {})[str(size)] = fit_curve(rows)
    return raw, fitted


# fived's trainer at negligible shapes on one rank: (layers, routed experts); the differences give the host
# time per dense layer, the step's own, per MoE layer without its experts' loop, per routed expert
HOST_MODELS = ((1, 0), (3, 0), (1, 4), (1, 8))


def _host_trainer(layers: int, experts: int, parallel: dict | None = None, microbatches: int = 1):
    from fived.training.trainer import Trainer

    return Trainer(host_config(layers, experts, parallel, microbatches), log=False)


def host_config(layers: int, experts: int, parallel: dict | None = None, microbatches: int = 1):
    """The config of a negligible model (`layers` layers, `experts` routed experts) on `parallel`'s layout,
    one sequence per micro-batch."""
    from fived.config import build_config

    parallel = parallel or {}
    over = {
        "model.name": "tiny",
        "model.n_layers": layers,
        "model.dim": 16,
        "model.n_heads": 2,
        "model.n_kv_heads": 1,
        "model.ffn_dim": 16,
        "model.vocab_size": 256,  # (the byte tokenizer's)
        "model.n_experts": experts,
        "train.seq_len": 32,  # (32 tokens x top-2: every one of 8 experts receives some)
        "train.global_batch": parallel.get("dp", 1) * microbatches,
        "train.microbatches": microbatches,
        "train.dtype": "float32",
        "train.device": "cpu" if not torch.cuda.is_available() else "cuda",
        "train.log_every": 10**9,
        "train.steps": 10**6,
    }
    if experts:
        over.update({"model.top_k": 2, "model.moe_ffn_dim": 16, "model.n_shared_experts": 1})
    if parallel:  # (a kv head per tp rank)
        over.update({"model.n_kv_heads": 2, **{f"parallel.{k}": v for k, v in parallel.items()}})
    return build_config(overrides=over)


def _rank_host(budget_s: float) -> dict:
    """Mean step seconds of each of HOST_MODELS, their steps interleaved."""
    trainers = [_host_trainer(layers, experts) for layers, experts in HOST_MODELS]
    times: list[list[float]] = [[] for _ in trainers]
    start, step = time.perf_counter(), 0
    while step < 5 or (time.perf_counter() - start < budget_s and step < 400):
        for i, t in enumerate(trainers):
            begin = time.perf_counter()
            t.step(step)
            if step >= 2:  # (after warm-up)
                times[i].append(time.perf_counter() - begin)
        step += 1
    return {"step_s": [statistics.fmean(ts) for ts in times], "steps": len(times[0])}


def measure_host(budget_s: float) -> dict:
    """Host time per dense layer and micro-batch (the slope over layers), per step (the rest), per MoE
    layer besides its routed experts' loop and per routed expert (the slope over experts), one rank."""
    got = run_ranks(1, _rank_host, budget_s, timeout_s=120.0)[0]
    dense1, dense3, moe4, moe8 = got["step_s"]
    layer = max((dense3 - dense1) / 2, 1e-6)
    step = max(dense1 - layer, 1e-6)
    expert = max((moe8 - moe4) / 4, 1e-7)
    return {
        "raw": {"models": [list(m) for m in HOST_MODELS], **got},
        "layer_overhead_s": layer,
        "step_overhead_s": step,
        "moe_layer_overhead_s": max(moe4 - step - 4 * expert, 1e-6),
        "expert_overhead_s": expert,
    }


def probe(slice_s: float) -> float:
    """Mean seconds of a small training-like mix (a linear's three GEMMs, element-wise ops) on one thread."""
    torch.set_num_threads(1)
    x, w, dy = torch.randn(256, 64), torch.randn(64, 64), torch.randn(256, 64)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 20 or time.perf_counter() - start < slice_s:
        begin = time.perf_counter()
        y = torch.mm(x, w)
        torch.mm(dy, w.t())
        torch.mm(x.t(), dy)
        torch.add(y, dy).mul_(0.5).relu_()
        times.append(time.perf_counter() - begin)
    return statistics.fmean(times)


def _rank_probe(slice_s: float, rounds: int) -> tuple[float, float]:
    """(rank 0's mean alone while the others wait, this rank's mean with every rank at once), alternated
    `rounds` times so that both see the same moments of the host's other load."""
    alone, together = [], []
    for _ in range(rounds):
        dist.barrier()
        if dist.get_rank() == 0:
            alone.append(probe(slice_s))
        dist.barrier()  # (all ranks at once, as a layout's ranks run)
        together.append(probe(slice_s))
    return (statistics.fmean(alone) if alone else float("nan")), statistics.fmean(together)


def measure_contention(nproc: int, slice_s: float, rounds: int = 4) -> dict:
    """How much slower one rank computes while `nproc` ranks compute at once than one alone (ranks sharing
    cores decide it, and the host's other load, which the single-process measurements already pay)."""
    got = run_ranks(nproc, _rank_probe, slice_s / rounds, rounds, timeout_s=120.0)
    alone, together = got[0][0], statistics.fmean(t for _, t in got)
    return {"alone_s": alone, "together_s": together, "nproc": nproc, "slowdown": max(1.0, together / alone)}


# fived's trainer at negligible shapes on the calibration's ranks (n, even), sharing the cores as a layout's
# ranks do: each dimension at 2 (data parallelism over the rest) and its base (data parallelism over all n,
# the same model), with 1 and 3 layers. Per layer, a dimension's run less its base's is what the dimension
# adds: its collectives as fived's layers issue them (autograd, DTensor, waits) and their host work, with
# bytes too small to matter. And a pipeline of 2 stages (a layer each) with 2 and 4 micro-batches: per
# micro-batch, what pp adds.
DIMENSION_BASES = {"tp": "dense base", "cp": "dense base", "ep": "moe base"}
DIMENSION_LAYERS = (1, 3)
PIPELINE_LAYERS = 2
PIPELINE_MICROBATCHES = (2, 4)


def dimension_layouts(n: int) -> tuple[tuple[str, dict, int], ...]:
    """(name, parallel fields on n ranks, routed experts) of each dimension's runs and their bases."""
    return (
        ("tp", {"tp": 2, "dp": n // 2}, 0),
        ("cp", {"cp": 2, "dp": n // 2}, 0),
        ("dense base", {"dp": n}, 0),
        ("ep", {"dp": n, "ep": 2}, 8),
        ("moe base", {"dp": n}, 8),
    )


def pipeline_layout(n: int) -> dict:
    return {"pp": 2, "dp": n // 2}


def dimension_runs(n: int) -> list[tuple[dict, int, int, int]]:
    """(parallel fields, routed experts, layers, micro-batches) of every trainer measure_dimensions times on
    n ranks: dimension_layouts x DIMENSION_LAYERS, then the pipeline's."""
    runs = [(par, experts, layers, 1) for _, par, experts in dimension_layouts(n) for layers in DIMENSION_LAYERS]
    return runs + [(pipeline_layout(n), 0, PIPELINE_LAYERS, micro) for micro in PIPELINE_MICROBATCHES]


def _rank_dimensions(budget_s: float) -> list[float]:
    """Mean step seconds of each of `dimension_runs` (that order), steps interleaved, each after a barrier
    (a step's time is its slowest rank's: see measure_dimensions)."""
    runs = dimension_runs(dist.get_world_size())
    trainers = [_host_trainer(layers, experts, parallel, micro) for parallel, experts, layers, micro in runs]
    times: list[list[float]] = [[] for _ in trainers]
    start, step, more = time.perf_counter(), 0, True
    while more:
        for i, t in enumerate(trainers):
            dist.barrier()
            begin = time.perf_counter()
            t.step(step)
            if step >= 2:  # (after warm-up)
                times[i].append(time.perf_counter() - begin)
        step += 1
        # the ranks agree to stop (each on its own clock, one could leave the others at the barrier)
        done = step >= 5 and (time.perf_counter() - start >= budget_s or step >= 400)
        flag = torch.tensor([float(done)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        more = flag.item() == 0
    return [statistics.fmean(ts) for ts in times]


def measure_dimensions(nproc: int, budget_s: float) -> dict:
    """{"step_s": {run name: [mean step seconds at each of DIMENSION_LAYERS, or the pipeline's at each of
    PIPELINE_MICROBATCHES]}, "added_s": {tp, cp, ep: what the dimension adds per layer and micro-batch;
    pp: per micro-batch}} on `nproc` fresh ranks (even; the slowest rank's mean)."""
    got = run_ranks(nproc, _rank_dimensions, budget_s, timeout_s=300.0)
    steps = [max(r[i] for r in got) for i in range(len(got[0]))]
    k, named = len(DIMENSION_LAYERS), dimension_layouts(nproc)
    step_s = {name: steps[i * k : (i + 1) * k] for i, (name, _, _) in enumerate(named)}
    step_s["pp"] = steps[len(named) * k :]
    added_s = {dim: per_layer(step_s[dim]) - per_layer(step_s[base]) for dim, base in DIMENSION_BASES.items()}
    added_s["pp"] = per_microbatch(step_s["pp"])
    return {
        "nproc": nproc,
        "step_s": step_s,
        "layers": list(DIMENSION_LAYERS),
        "microbatches": list(PIPELINE_MICROBATCHES),
        "added_s": added_s,
    }


def per_layer(steps: list[float]) -> float:
    """Seconds per layer between the DIMENSION_LAYERS runs' steps."""
    return (steps[-1] - steps[0]) / (DIMENSION_LAYERS[-1] - DIMENSION_LAYERS[0])


def per_microbatch(steps: list[float]) -> float:
    """Seconds per micro-batch between the pipeline's PIPELINE_MICROBATCHES runs' steps."""
    return (steps[-1] - steps[0]) / (PIPELINE_MICROBATCHES[-1] - PIPELINE_MICROBATCHES[0])


def unpriced_dimensions(doc: dict, name: str, measured: dict) -> dict[str, float]:
    """What fived's trainer measured on the calibration's ranks (`measured`: measure_dimensions' step_s and
    added_s) beyond what the planner, priced by `doc` (a profile being written), puts there; at a whole
    core (the ranks' slowdown taken out), each never below 0. First the ranks' own (`profile.RANKS_KEYS`):
    the dense data-parallel base's steps against their price, per layer and micro-batch and per step,
    then the MoE base's beyond those; then, priced with those, what tp, cp and ep add per layer and
    micro-batch against their base, pp per micro-batch."""
    from fived.planner.profile import RANKS_KEYS

    step_s, at_a_core = measured["step_s"], 1 / _slowdown_of(doc, name)
    layouts = {run: (parallel, experts) for run, parallel, experts in dimension_layouts(doc["nproc"])}
    figures: dict[str, float] = {}
    for run, keys in (("dense base", RANKS_KEYS[:2]), ("moe base", RANKS_KEYS[2:])):
        priced = _pricer(doc, name, figures)
        beyond = [
            (m - priced(*layouts[run], layers, 1)) * at_a_core for layers, m in zip(DIMENSION_LAYERS, step_s[run])
        ]
        figures.update(zip(keys, line_at_or_above_zero(DIMENSION_LAYERS, beyond)))
    priced = _pricer(doc, name, figures)

    def priced_per_layer(run: str) -> float:
        return per_layer([priced(*layouts[run], layers, 1) for layers in DIMENSION_LAYERS])

    added = measured["added_s"]
    predicted = {dim: priced_per_layer(dim) - priced_per_layer(base) for dim, base in DIMENSION_BASES.items()}
    pipeline = pipeline_layout(doc["nproc"])
    predicted["pp"] = per_microbatch([priced(pipeline, 0, PIPELINE_LAYERS, micro) for micro in PIPELINE_MICROBATCHES])
    return {**{dim: max(0.0, added[dim] - predicted[dim]) * at_a_core for dim in predicted}, **figures}


def line_at_or_above_zero(xs: tuple[int, ...], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the line through two points (xs[0], ys[0]), (xs[1], ys[1]), neither below 0: a
    negative slope is refitted flat (the points' mean), a negative intercept through the origin (least
    squares); both negative: (0, 0). So a clamped figure never leaves the other one fitted to a line
    the clamp discarded."""
    slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
    intercept = ys[0] - slope * xs[0]
    if slope < 0:
        slope, intercept = 0.0, sum(ys) / len(ys)
    elif intercept < 0:
        slope, intercept = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0
    return max(0.0, slope), max(0.0, intercept)


def _pricer(doc: dict, name: str, figures: dict[str, float]):
    """priced(parallel, routed experts, layers, micro-batches): the planner's step of `host_config`'s
    negligible model on the calibration's ranks, priced by `doc` with `figures` as its dimension_s."""
    from fived.layout.layout import Layout
    from fived.planner.profile import profile_hardware
    from fived.planner.timing import Cluster, step_time

    profile = _profile_of(doc, name, figures)
    n = profile.nproc
    cluster = Cluster(profile_hardware(profile, n), n, n)

    def priced(parallel: dict, experts: int, layers: int, micro: int) -> float:
        cfg = host_config(layers, experts, parallel, micro)
        t = cfg.train
        return step_time(cfg.model, Layout.from_config(cfg, n), cluster, t.seq_len, t.global_batch, t.dtype).total

    return priced


def _profile_of(doc: dict, name: str, figures: dict[str, float]):
    from fived.planner.profile import FORMAT, VERSION, profile_of

    fitted = {**doc["fitted"], "dimension_s": dict(figures)}
    return profile_of({"format": FORMAT, "version": VERSION, **doc, "fitted": fitted}, name)


def _slowdown_of(doc: dict, name: str) -> float:
    from fived.planner.profile import slowdown

    profile = _profile_of(doc, name, {})
    return slowdown(profile, profile.nproc)
