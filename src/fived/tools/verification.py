"""`fived verify`: train a layout and the single-process reference on the same global batches in
float64 and compare losses, gradient norms and final parameters.

Relative difference: |a - b| / |b| for scalars (per step), ||a - b|| / ||b|| for each parameter tensor
(Frobenius norm). In float64 a correct layout differs from the reference only by summation order,
~1e-15..1e-12; a wrong reduction or a mis-sharded parameter shows up as 1e-3 or more.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import math
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from fived.checkpoint.checkpointer import find_checkpoint
from fived.config import Config, ParallelConfig
from fived.launch.ranks import run_ranks
from fived.layout.rules import check_config
from fived.parallel.mesh import resolve_dp
from fived.training.trainer import TrainResult, train_rank

TOLERANCE = 1e-9


@dataclass
class VerifyReport:
    rows: list[dict] = field(default_factory=list)  # per step: ref/layout loss, aux, grad norm
    max_rel: dict[str, float] = field(default_factory=dict)  # loss, grad_norm, params (+ aux_loss, mtp_loss)
    worst_param: str = ""

    @property
    def max_relative_difference(self) -> float:
        return max(self.max_rel.values())

    @property
    def ok(self) -> bool:
        return self.max_relative_difference <= TOLERANCE


def _rel(a: float, b: float) -> float:
    diff = abs(a - b) / max(abs(b), 1e-300)
    return diff if math.isfinite(diff) else math.inf  # a NaN must fail, not compare as "not larger"


def _describe(cfg: Config, world: int) -> str:
    p = cfg.parallel
    return (
        f"{world} rank(s) dp={resolve_dp(cfg, world)} tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep} zero={p.zero}"
        + (f" dp_replicate={p.dp_replicate}" if p.dp_replicate > 1 else "")
        + (" sp" if p.sp else "")
        + (f" {p.pp_schedule}" if p.pp > 1 else "")
    )


def reference_config(cfg: Config) -> Config:
    """The same run on one process: no parallelism, the whole global batch in one micro-batch, eager
    (a compiled layout is checked against the uncompiled model)."""
    ref = copy.deepcopy(cfg)
    ref.parallel = ParallelConfig(dp=1)
    ref.train.microbatches = 1
    ref.train.compile = False
    return ref


# Reference results kept by reference_run, keyed by the reference run's whole configuration; None (the
# default): every run_verify trains its own reference. The test suite turns this on (tests/conftest.py):
# about 200 verifications there share a few dozen references, each a run of its own otherwise.
REFERENCE_CACHE: dict[str, TrainResult] | None = None
# Inputs read from outside the configuration (a run to start from, blends of files) or written there: a
# reference run with any of these set is never taken from the cache.
_UNCACHED_IF_SET = (
    ("train", "init_from"),
    ("train", "trace"),
    ("train", "profile"),
    ("data", "blend"),
    ("data", "valid_blend"),
)
# Data files: keyed by what they hold, not where (each test writes its documents at a path of its own).
_KEYED_BY_CONTENT = (("data", "path"), ("data", "val_path"))


def _cache_key(ref: Config) -> str | None:
    if ref.data.tokenizer != "byte" or any(getattr(getattr(ref, s), k) for s, k in _UNCACHED_IF_SET):
        return None
    described = ref.to_dict()
    del described["train"]["output_dir"]  # (unused: the reference runs with log=False and writes nothing)
    for section, key in _KEYED_BY_CONTENT:
        if described[section][key]:
            described[section][key] = _content_digest(described[section][key])
            if described[section][key] is None:
                return None
    return json.dumps(described, sort_keys=True)


def _content_digest(path: str) -> str | None:
    """A digest of every file the loader may read for `path`: the files beside it named like it
    (`x` or `x.*`: a token file's .bin, its sidecar .json, a Megatron .idx, a prepared validation
    split), names and bytes; None where there is none."""
    given = Path(path)
    stem = given.name.split(".")[0]
    if not stem or given.is_dir():
        return None
    named = (given.parent / stem, *given.parent.glob(glob.escape(stem) + ".*"))
    files = sorted(f for f in named if f.is_file())
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return "sha256:" + digest.hexdigest()


def reference_run(ref: Config) -> TrainResult:
    """The single-process run at `ref` (a reference_config), on one forked rank; from REFERENCE_CACHE
    when that is on and holds this configuration (a copy: callers may not share the cached tensors)."""
    cache = REFERENCE_CACHE
    key = _cache_key(ref) if cache is not None else None
    if cache is None or key is None or key not in cache:
        result = run_ranks(
            1, partial(train_rank, ref, log=False, progress=False, return_state=True), device=ref.train.device
        )[0]
        if cache is None or key is None:
            return result
        cache[key] = result
    return copy.deepcopy(cache[key])


def compare(ref: TrainResult, lay: TrainResult) -> VerifyReport:
    report = VerifyReport()
    keys = ["loss", "grad_norm"] + [k for k in ("aux_loss", "mtp_loss") if k in ref.metrics[0]]
    for key in keys:
        report.max_rel[key] = 0.0
    for r, l in zip(ref.metrics, lay.metrics, strict=True):
        row = {"step": r["step"]}
        for key in keys:
            row[key] = (r[key], l[key])
            report.max_rel[key] = max(report.max_rel[key], _rel(l[key], r[key]))
        report.rows.append(row)
    evaluated = [(r["val_loss"], l["val_loss"]) for r, l in zip(ref.metrics, lay.metrics) if "val_loss" in r]
    if evaluated:  # (train.eval_every: the validation loss is layout-independent too)
        report.max_rel["val_loss"] = max(_rel(l, r) for r, l in evaluated)
    if "loss_by_source" in ref.metrics[0]:  # (a blend: each source's loss is layout-independent too)
        report.max_rel["loss_by_source"] = max(_source_rel(r, l) for r, l in zip(ref.metrics, lay.metrics))
    if set(ref.state) != set(lay.state):
        raise ValueError(f"parameter names differ: {sorted(set(ref.state) ^ set(lay.state))}")
    report.max_rel["params"] = 0.0
    for name, expected in ref.state.items():
        diff = (
            torch.linalg.vector_norm(lay.state[name].double() - expected.double())
            / torch.linalg.vector_norm(expected.double()).clamp_min(1e-300)
        ).item()
        diff = diff if math.isfinite(diff) else math.inf
        if diff >= report.max_rel["params"]:
            report.max_rel["params"], report.worst_param = diff, name
    return report


def _source_rel(ref: dict, lay: dict) -> float:
    """The worst relative difference of a step's per-source losses (a source with no tokens in the
    step has None in both, or the difference is infinite)."""
    worst = 0.0
    for name, expected in ref["loss_by_source"].items():
        got = lay.get("loss_by_source", {}).get(name)
        if expected is None or got is None:
            worst = worst if expected is got else math.inf
        else:
            worst = max(worst, _rel(got, expected))
    return worst


def run_layout(cfg: Config, world: int, reshard_from: tuple[Config, int] | None = None) -> list[TrainResult]:
    """Every rank's results of the run at `cfg`, or, with `reshard_from=(config, world)`, of its first
    half at that other layout, saved, and its second half resumed from that checkpoint at `cfg`."""
    device = cfg.train.device
    if reshard_from is None:
        return run_ranks(world, partial(train_rank, cfg, log=False, progress=False, return_state=True), device=device)
    first, first_world = copy.deepcopy(reshard_from[0]), reshard_from[1]
    first.checkpoint.final = True  # (the second half starts from the first half's last step)
    second = copy.deepcopy(cfg)
    half = cfg.train.steps // 2
    with tempfile.TemporaryDirectory(prefix="fived-reshard-") as run_dir:
        first.train.output_dir = second.train.output_dir = run_dir
        before = run_ranks(first_world, partial(train_rank, first, progress=False, until=half), device=device)[0]
        checkpoint = str(find_checkpoint(run_dir))
        after = run_ranks(
            world, partial(train_rank, second, progress=False, return_state=True, resume=checkpoint), device=device
        )
    return [TrainResult(metrics=before.metrics + r.metrics, state=r.state) for r in after]


def run_verify(cfg: Config, world: int, printer=print, reshard_from: tuple[Config, int] | None = None) -> VerifyReport:
    cfg = copy.deepcopy(cfg)
    cfg.train.dtype = "float64"
    cfg.train.fp8 = "none"  # (FP8 rounding is no property of the layout, and float64 is what checks it)
    check_config(cfg, world)  # a clear error here rather than from every rank
    ref = reference_run(reference_config(cfg))
    if reshard_from is not None:
        first = copy.deepcopy(reshard_from[0])
        first.train.dtype, first.train.fp8 = "float64", "none"
        check_config(first, reshard_from[1])
        reshard_from = (first, reshard_from[1])
        printer(
            f"steps 1-{cfg.train.steps // 2} at {_describe(first, reshard_from[1])}, checkpointed, "
            f"resumed at {_describe(cfg, world)}"
        )
    layout = run_layout(cfg, world, reshard_from)
    # Every rank's losses, norms and (gathered) parameters against the reference: the worst counts.
    report = max((compare(ref, lay) for lay in layout), key=lambda r: r.max_relative_difference)
    keys = [k for k in report.rows[0] if k != "step"]
    printer("step  " + "  ".join(f"{'ref ' + k:>22}  {'layout ' + k:>22}" for k in keys))
    for row in report.rows:
        printer(f"{row['step']:>4}  " + "  ".join(f"{row[k][0]:>22.15g}  {row[k][1]:>22.15g}" for k in keys))
    for key, value in report.max_rel.items():
        where = f" ({report.worst_param})" if key == "params" else ""
        printer(f"max relative difference in {key}: {value:.3e}{where}")
    printer(f"{'OK' if report.ok else 'FAILED'}: tolerance {TOLERANCE:g}")
    printer(f"max relative difference: {report.max_relative_difference:.3e}")
    return report
