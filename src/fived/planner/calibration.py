"""`fived plan --validate FILE.csv`: the planner against published training runs, in sample and out of
sample, and the fit of its constants (`python -m fived.planner.calibration FILE.csv`).

Each row (`fived.planner.published`) states a model, a cluster, a layout, the framework it ran and a
measured throughput. The prediction is the planner's step time for that layout in that runtime,
its open fields completed by the fastest choice that fits the memory model (or the fastest, when
none fits: the run happened, so it did fit; `fits` counts how often the memory model agrees).

Fitted constants (`GRIDS`): the share of peak wide GEMMs reach per GPU generation, the width at
which it halves, the share of link bandwidth collectives reach, the share of tp communication
Megatron-Core's --tp-comm-overlap hides, the FP8 GEMM speed-up, routed experts' share of a dense
GEMM's efficiency. Not fitted: the tokens per GEMM at which efficiency halves (timing.ROWS_HALF):
every GEMM in the set has thousands of tokens, so the data cannot tell it. Coordinate descent
over a grid; the layouts' open fields are chosen once, before the
descent (they hardly depend on these constants), so a fit costs one step time per row and value.
The descent minimises the mean absolute error (every row pulls on the constants; the median, which
validation reports, would leave a constant that only a few rows depend on undetermined).

Out of sample: leave-one-source-out refits the constants without each source's rows and predicts
that source with them; the median absolute error over all rows so predicted is the figure to expect
for a run unlike the calibration set's. `OUT_OF_SAMPLE_ERROR` is what it printed on
tests/data/published_runs.csv (tested): `fived plan` quotes it as the basis of a prediction.
"""
from __future__ import annotations

import statistics
from typing import Any
from dataclasses import replace
from pathlib import Path

from fived.layout.layout import Layout
from fived.planner import runtimes, timing
from fived.planner.published import Row, read_runs
from fived.planner.search import Plan, evaluate, expand

OUT_OF_SAMPLE_ERROR = 10.4  # leave-one-source-out median absolute error, % (validate prints it)
# What tests/data/published_runs.csv covers (tests/test_planner.py checks it against the file)
COVERAGE: dict[str, Any] = {"rows": 76, "ampere": 48, "hopper": 28, "moe": 2, "fp8": 4, "cp": 0, "max_seq": 8192,
            "gpus": ("a100", "a800", "h100", "h800")}
GRIDS = {"ampere": [0.40 + 0.025 * i for i in range(21)], "hopper": [0.40 + 0.025 * i for i in range(21)],
         "WIDTH_HALF": [0.0, 32.0, 64.0, 128.0, 256.0, 512.0],
         "LINK_EFFICIENCY": [0.5, 0.6, 0.7, 0.8, 0.9], "MCORE_TP_OVERLAP": [0.0, 0.25, 0.5, 0.75, 1.0],
         "FP8_SPEEDUP": [1.0, 1.2, 1.4, 1.6, 1.8, 2.0], "EXPERT_EFFICIENCY": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]}


def constants() -> dict[str, float]:
    out = {name: timing.EFFICIENCY[name] for name in ("ampere", "hopper")}
    out.update(WIDTH_HALF=timing.WIDTH_HALF, LINK_EFFICIENCY=timing.LINK_EFFICIENCY,
               MCORE_TP_OVERLAP=runtimes.MCORE_TP_OVERLAP, FP8_SPEEDUP=timing.FP8_SPEEDUP,
               EXPERT_EFFICIENCY=timing.EXPERT_EFFICIENCY)
    return out


def set_constants(values: dict[str, float]) -> None:
    for name, value in values.items():
        if name in ("ampere", "hopper"):
            timing.EFFICIENCY[name] = value
        elif name == "MCORE_TP_OVERLAP":
            runtimes.MCORE_TP_OVERLAP = value
        else:
            setattr(timing, name, value)


def _runtime(row: Row):
    """The row's runtime with the current tp-overlap constant (it is fitted)."""
    if row.runtime.tp_overlap:
        return replace(row.runtime, tp_overlap=runtimes.MCORE_TP_OVERLAP)
    return row.runtime


def candidates(row: Row) -> list[Layout]:
    """Every completion of the row's layout (dp follows an open tp or pp)."""
    base = Layout(**row.fixed)
    out = []
    for layout in expand(base, row.open):
        dp = row.cluster.gpus // (layout.tp * layout.pp * layout.cp)
        if dp >= 1 and dp * layout.tp * layout.pp * layout.cp == row.cluster.gpus:
            out.append(layout.with_(dp=dp, dp_replicate=layout.dp_replicate if dp % layout.dp_replicate == 0 else 1))
    return out


def batch(row: Row, layout: Layout) -> int:
    """The row's global batch, or one micro-batch per data-parallel rank where it states none."""
    return row.global_batch or layout.dp * layout.micro_batch


def predict(row: Row) -> Plan | None:
    """The fastest completion of the row's layout that fits in memory, else the fastest (its plan's
    `fits` is then False); None when no completion is a layout the planner can cost."""
    evaluated = [evaluate(row.model, layout, row.cluster, row.seq_len, batch(row, layout), runtime=_runtime(row))
                 for layout in candidates(row)]
    plans = [p for p in evaluated if p is not None]
    # fastest per token: an open batch size changes the tokens a step processes
    return min(plans, key=lambda p: (not p.fits, -p.time.tokens_per_s_per_gpu)) if plans else None


def _error(row: Row, plan: Plan) -> float:
    return plan.time.tokens_per_s_per_gpu / row.reported - 1


def _retime(row: Row, layout: Layout) -> float:
    """The signed error of `layout` for `row` under the current constants."""
    from fived.planner.timing import step_time

    t = step_time(row.model, layout, row.cluster, row.seq_len, batch(row, layout), "bfloat16", _runtime(row))
    return t.tokens_per_s_per_gpu / row.reported - 1


def fit(rows: list[Row], chosen: list[Layout], verbose: bool = False) -> dict[str, float]:
    """Coordinate descent over GRIDS (two sweeps) minimising the mean absolute error of `rows` with
    their layouts `chosen`; leaves the best constants set and returns them. A constant no row depends
    on (FP8 without FP8 rows) keeps its value."""
    def error() -> float:  # the mean, not the median: every row pulls, a constant few rows decide is fitted too
        return statistics.fmean(abs(_retime(r, layout)) for r, layout in zip(rows, chosen))

    for _ in range(2):
        for name, grid in GRIDS.items():
            scores = []
            for value in grid:
                set_constants({name: value})
                scores.append((round(error(), 9), abs(value - constants()[name]), value))
            best = min(scores)  # ties: the value nearest the current one
            set_constants({name: best[2]})
            if verbose:
                print(f"{name} = {best[2]:.3f}  (mean absolute error {best[0] * 100:.1f}%)", flush=True)
    return constants()


def leave_one_source_out(rows: list[Row], chosen: list[Layout]) -> dict[str, list[float]]:
    """Per source: the signed errors of its rows predicted by constants fitted on the other sources."""
    base = constants()
    out: dict[str, list[float]] = {}
    try:
        for source in sorted({r.source for r in rows}):
            train = [(r, layout) for r, layout in zip(rows, chosen) if r.source != source]
            set_constants(base)
            fit([r for r, _ in train], [layout for _, layout in train])
            out[source] = [_retime(r, layout) for r, layout in zip(rows, chosen) if r.source == source]
    finally:
        set_constants(base)
    return out


def validate(path: str | Path, printer=print, out_of_sample: bool = True) -> dict:
    """Print predicted vs reported per row, the skipped rows, the fit of the memory model, the
    leave-one-source-out error, the coverage and, last, the in-sample median absolute error."""
    rows, skipped = read_runs(path)
    printer(f"{'row':>4} {'source':<26} {'gpus':>5} {'layout (planner-chosen fields: see notes)':<54} {'reported':>9} "
            f"{'predicted':>9} {'error':>7}  notes")
    done, chosen, errors, fits = [], [], [], 0
    for row in rows:
        plan = predict(row)
        if plan is None:
            skipped.append(f"row {row.row_id} skipped: no completion of {Layout(**row.fixed).describe()} is a layout "
                           "the planner can cost (check tp/pp/dp against heads, layers and the global batch)")
            continue
        err = _error(row, plan)
        done.append(row)
        chosen.append(plan.layout)
        errors.append(err)
        fits += plan.fits
        notes = row.notes + ([] if plan.fits else ["our memory model: does not fit"])
        if not plan.layout.runnable:
            notes.append("not runnable by fived yet")
        printer(f"{row.row_id:>4} {row.source[:26]:<26} {row.cluster.gpus:>5} {plan.layout.describe()[:54]:<54} "
                f"{row.reported:>9.1f} {plan.time.tokens_per_s_per_gpu:>9.1f} {err * 100:>+6.1f}%  {'; '.join(notes)}")
    for line in skipped:
        printer(line)
    median = statistics.median(abs(e) for e in errors) * 100 if errors else float("nan")
    result: dict[str, Any] = {"rows": len(done) + len(skipped), "predicted": len(done), "fits": fits, "median": median}
    printer(f"memory: {fits} of {len(done)} published runs fit in the planner's memory model "
            f"({fits / max(len(done), 1):.0%})")
    if out_of_sample and len({r.source for r in done}) > 1:
        per_source = leave_one_source_out(done, chosen)
        loso = [abs(e) for errs in per_source.values() for e in errs]
        result["loso"] = statistics.median(loso) * 100
        result["loso_by_source"] = {s: statistics.median(abs(e) for e in errs) * 100 for s, errs in per_source.items()}
        printer("leave-one-source-out (constants fitted without the source): " + ", ".join(
            f"{s} {v:.1f}%" for s, v in result["loso_by_source"].items()))
        printer(f"leave-one-source-out median absolute error: {result['loso']:.1f}%")
    printer(f"predicted {len(done)} of {result['rows']} rows")
    printer(f"median absolute error: {median:.1f}%")
    return result


def fit_file(path: str | Path) -> dict[str, float]:
    """Refit the constants on every row of `path` (what timing.py and runtimes.py hold is what this
    printed on tests/data/published_runs.csv)."""
    rows, _ = read_runs(path)
    predicted = [(r, predict(r)) for r in rows]
    plans = [(r, p) for r, p in predicted if p is not None]
    return fit([r for r, _ in plans], [p.layout for _, p in plans], verbose=True)


if __name__ == "__main__":  # python -m fived.planner.calibration tests/data/published_runs.csv
    import sys

    print(fit_file(sys.argv[1]))
