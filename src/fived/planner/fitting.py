"""The fit of the planner's constants on published runs, and the calibration file it writes:

    python -m fived.planner.fitting tests/data/published_runs.csv        # src/fived/planner/calibration.json
    python -m fived.planner.fitting runs.csv --out my-calibration.json

Each row (`fived.planner.published`) states a model, a cluster, a layout, the framework it ran and a
measured throughput. Its prediction is the planner's step time for that layout in that runtime, its
open fields completed by the fastest choice that fits the memory model (or the fastest, when none
fits: the run happened, so it did fit).

The fit: coordinate descent over `GRIDS` (sweeps until none changes a constant) from the priors
(`Constants()`) and from every constant at its grid's middle value, the better of the two, minimising
the mean absolute error (every row pulls on the constants; the median, which validation reports,
would leave a constant only a few rows depend on undetermined). The layouts' open fields are chosen
with the priors, then again with the fitted constants, and the fit repeated once (the errors are
measured on the layouts the final constants choose, as `fived plan --validate` prices them): a fit
costs one step time per row and grid value, less those `ThroughputMemo` already holds. A constant no
row depends on (FP8 without FP8 rows) keeps its prior.

Held out: rows whose `split` is "test" (`fived.planner.published`) are dropped before anything
else — no fit, no choice of layouts, no leave-one-source-out refit reads them; once the constants
are final they are predicted with them, their errors only reported (`Calibration.held_out`).

Out of sample: leave-one-source-out refits the constants, from the priors, without each source's
rows (of the fitting split) and predicts that source with them; the median absolute error over all
rows so predicted is the figure to expect for a run unlike the calibration set's. `calibrate` returns both, with the file
they came from, as one `fived.planner.constants.Calibration`; `fived plan` quotes its figures.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import fields, replace
from pathlib import Path

from fived.layout.layout import Layout
from fived.layout.schedule_sim import check_schedule
from fived.planner.constants import DEFAULT_PATH, Calibration, Constants, file_sha256, save_calibration
from fived.planner.published import Row, read_runs, row_kinds
from fived.planner.search import Plan, evaluate, expand
from fived.planner.timing import step_time

PRIORS = Constants()
GRIDS = {
    "efficiency_ampere": [round(0.40 + 0.025 * i, 3) for i in range(21)],
    "efficiency_hopper": [round(0.40 + 0.025 * i, 3) for i in range(21)],
    "width_half": [0.0, 32.0, 64.0, 128.0, 256.0, 512.0],
    "depth_half": [0.0, 256.0, 512.0, 1024.0, 2048.0],
    "link_efficiency": [0.5, 0.6, 0.7, 0.8, 0.9],
    "ring_step_latency_s": [0.0, 5e-6, 10e-6, 20e-6, 40e-6, 80e-6],
    "cross_node_rails": [1.0, 1.5, 2.0, 3.0, 4.0, 8.0],
    "tp_overlap": [0.0, 0.25, 0.5, 0.75, 1.0],
    "fp8_speedup": [1.0, 1.2, 1.4, 1.6, 1.8, 2.0],
    "expert_efficiency": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
}


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
    """The global batch `layout` is priced at: the row's, or one micro-batch per data-parallel rank
    where it states none; micro-batches the schedule simulator cannot run (torch's interleaved
    schedule wants whole rounds; Megatron's does not) rounded down to the nearest it can — the
    throughput per token hardly changes."""
    stated = row.global_batch or layout.dp * layout.micro_batch
    per_step = layout.dp * layout.micro_batch
    if layout.pp == 1 or stated % per_step:
        return stated
    for m in range(stated // per_step, layout.pp - 1, -1):
        try:
            check_schedule(layout.pp_schedule, layout.pp, layout.pp_virtual, m)
            return m * per_step
        except ValueError:
            continue
    return stated


def predict(row: Row, constants: Constants | None = None) -> Plan | None:
    """The fastest completion of the row's layout that fits in memory, else the fastest (its plan's
    `fits` is then False). A run that happened is costed even where fived's own rules refuse every
    completion (torch's schedules' micro-batch rounds, ...): then among those the step-time model can
    price (a layer per stage, whole micro-batches). None when none is."""

    def priced(layouts, checked):
        plans = [
            evaluate(
                row.model,
                layout,
                row.cluster,
                row.seq_len,
                batch(row, layout),
                runtime=row.runtime,
                checked=checked,
                constants=constants,
            )
            for layout in layouts
        ]
        return [p for p in plans if p is not None]

    plans = priced(candidates(row), False) or priced(
        [layout for layout in candidates(row) if costable(row, layout)], True
    )
    # fastest per token: an open batch size changes the tokens a step processes
    return min(plans, key=lambda p: (not p.fits, -p.time.tokens_per_s_per_gpu)) if plans else None


def costable(row: Row, layout: Layout) -> bool:
    """The step-time and memory models can price `layout` for `row` (a layer per stage, whole
    micro-batches, a schedule the simulator runs), whatever fived's other rules say."""
    if layout.n_stages > row.model.n_layers or batch(row, layout) % (layout.dp * layout.micro_batch):
        return False
    try:
        check_schedule(layout.pp_schedule, layout.pp, layout.pp_virtual, layout.microbatches(batch(row, layout)))
    except ValueError:
        return False
    return True


def signed_error(row: Row, layout: Layout, constants: Constants) -> float:
    """predicted / reported - 1 for `row` run as `layout`, priced with `constants`."""
    return THROUGHPUT.tokens_per_s_per_gpu(row, layout, constants) / row.reported - 1


class _ReadConstants(Constants):
    """Constants that note which of their fields are read (its methods read through it too: a
    `gemm_efficiency` call notes the generation's efficiency)."""

    def __getattribute__(self, name: str):
        if name in _FIELD_NAMES:
            object.__getattribute__(self, "__dict__").setdefault("_read", []).append(name)
        return object.__getattribute__(self, name)


_FIELD_NAMES = frozenset(f.name for f in fields(Constants))


class ThroughputMemo:
    """The step-time model's tokens/s per GPU of a row run as a layout, remembered by the values of
    only the constants it read. A fit prices every row at every grid value of every constant, and
    most rows read few of them (a Hopper row never reads the Ampere efficiency, a dense one never the
    experts'): the same figure again. Exact: a deterministic computation that reads the same values
    takes the same path to the same result, so a new `Constants` equal on the fields a stored result
    read has that result. (One memo per process: fits on the same rows, in one `calibrate` or in
    several, share it; bounded by `limit` entries. A row is never changed once read: its objects are
    keys.)"""

    def __init__(self, *, limit: int = 200_000) -> None:
        self.limit = limit
        self.entries: dict[tuple, dict[tuple[str, ...], dict[tuple, float]]] = {}
        # (id(row), id(layout)) -> (row, layout, its batch, its entry): a fit asks for the same objects
        # again and again, and hashing a model and a layout per call costs a third of a hit
        self.by_identity: dict[tuple[int, int], tuple[Row, Layout, int, dict]] = {}
        self.size = 0

    def _entry(self, row: Row, layout: Layout) -> tuple[int, dict[tuple[str, ...], dict[tuple, float]]]:
        known = self.by_identity.get((id(row), id(layout)))
        if known is not None and known[0] is row and known[1] is layout:  # (held here: ids not reused)
            return known[2], known[3]
        priced_batch = batch(row, layout)
        key = (row.model, row.cluster, row.runtime, row.seq_len, priced_batch, layout)
        by_read = self.entries.setdefault(key, {})
        self.by_identity[id(row), id(layout)] = (row, layout, priced_batch, by_read)
        return priced_batch, by_read

    def tokens_per_s_per_gpu(self, row: Row, layout: Layout, constants: Constants) -> float:
        priced_batch, by_read = self._entry(row, layout)
        for names, results in by_read.items():
            hit = results.get(tuple(getattr(constants, n) for n in names))
            if hit is not None:
                return hit
        reading = _ReadConstants(**{n: getattr(constants, n) for n in _FIELD_NAMES})
        t = step_time(
            row.model, layout, row.cluster, row.seq_len, priced_batch, "bfloat16", row.runtime, constants=reading
        )
        names = tuple(sorted(set(reading.__dict__.get("_read", ()))))
        if self.size >= self.limit:  # (forget all: fits that share figures run one after another)
            self.entries.clear()
            self.by_identity.clear()
            self.size = 0
            priced_batch, by_read = self._entry(row, layout)
        by_read.setdefault(names, {})[tuple(getattr(constants, n) for n in names)] = t.tokens_per_s_per_gpu
        self.size += 1
        return t.tokens_per_s_per_gpu


THROUGHPUT = ThroughputMemo()


def fit(rows: list[Row], chosen: list[Layout], verbose: bool = False, sweeps: int = 6) -> Constants:
    """The constants minimising the mean absolute error of `rows` run as `chosen`: coordinate descent
    from the priors and from every constant at its grid's middle value (the shape constants trade off
    against the efficiencies, so one start can stall), the better of the two."""
    middle = replace(PRIORS, **{name: grid[len(grid) // 2] for name, grid in GRIDS.items()})
    fits = [descend(rows, chosen, start, verbose, sweeps) for start in (PRIORS, middle)]
    return min(fits, key=lambda f: (f[0], fits.index(f)))[1]


def descend(
    rows: list[Row], chosen: list[Layout], start: Constants, verbose: bool = False, sweeps: int = 6
) -> tuple[float, Constants]:
    """Coordinate descent over GRIDS from `start`, sweep after sweep until none changes a constant (at
    most `sweeps`); ties go to the value nearest the current one. (mean absolute error, constants)."""
    current, best = start, (float("inf"), 0.0, 0.0)

    def error(constants: Constants) -> float:
        return statistics.fmean(abs(signed_error(r, layout, constants)) for r, layout in zip(rows, chosen))

    for _ in range(sweeps):
        before = current
        for name, grid in GRIDS.items():
            now = getattr(current, name)
            scores = [(round(error(replace(current, **{name: value})), 9), abs(value - now), value) for value in grid]
            best = min(scores)
            if len({score for score, _, _ in scores}) == 1:  # no row depends on it: its prior
                best = (best[0], 0.0, getattr(PRIORS, name))
            current = replace(current, **{name: best[2]})
            if verbose:
                print(f"{name} = {best[2]:g}  (mean absolute error {best[0] * 100:.2f}%)", flush=True)
        if current == before:
            break
    return best[0], current


def leave_one_source_out(rows: list[Row], chosen: list[Layout]) -> dict[str, float]:
    """Per row id: its signed error predicted by constants fitted (from the priors) without its source."""
    out: dict[str, float] = {}
    for source in sorted({r.source for r in rows}):
        train = [(r, layout) for r, layout in zip(rows, chosen) if r.source != source]
        constants = fit([r for r, _ in train], [layout for _, layout in train])
        out.update(
            {r.row_id: signed_error(r, layout, constants) for r, layout in zip(rows, chosen) if r.source == source}
        )
    return out


def median_abs(errors) -> float:
    """Median absolute error, % (nan for none)."""
    errors = [abs(e) for e in errors]
    return statistics.median(errors) * 100 if errors else float("nan")


def coverage(rows: list[Row]) -> dict:
    """What a calibration set holds: rows per GPU generation, MoE, FP8 and context-parallel rows,
    the longest sequence and the GPU families."""
    return {
        "rows": len(rows),
        "ampere": sum(r.cluster.hardware.calibration == "ampere" for r in rows),
        "hopper": sum(r.cluster.hardware.calibration == "hopper" for r in rows),
        "moe": sum(r.model.is_moe for r in rows),
        "fp8": sum(r.runtime.fp8 for r in rows),
        "cp": sum(r.fixed.get("cp", 1) > 1 for r in rows),
        "max_seq": max(r.seq_len for r in rows),
        "gpus": sorted({r.cluster.hardware.name.split("-")[0] for r in rows}),
        "sources": len({r.source for r in rows}),
    }


def choose_layouts(rows: list[Row], constants: Constants) -> tuple[list[Row], list[Layout]]:
    """The rows the planner can cost, each with its completed layout under `constants`."""
    plans = [(r, predict(r, constants)) for r in rows]
    kept = [(r, p.layout) for r, p in plans if p is not None]
    return [r for r, _ in kept], [layout for _, layout in kept]


def calibrate(path: str | Path, name: str | None = None, verbose: bool = False) -> Calibration:
    """Fit the constants on the rows of `path` its split lets a fit read, measure the fit in and out
    of sample, and only then predict the held-out rows (split "test") with the final constants."""
    rows, _ = read_runs(path)
    held, rows = [r for r in rows if r.held_out], [r for r in rows if not r.held_out]
    rows, chosen = choose_layouts(rows, PRIORS)
    constants = fit(rows, chosen)
    rows, chosen = choose_layouts(rows, constants)  # the open fields again, with the fitted constants
    constants = fit(rows, chosen, verbose=verbose)
    rows, chosen = choose_layouts(rows, constants)  # as validation completes them with these constants
    loso = leave_one_source_out(rows, chosen)
    by_source = {s: median_abs(loso[r.row_id] for r in rows if r.source == s) for s in sorted({r.source for r in rows})}
    kinds = sorted({k for r in rows for k in row_kinds(r)})
    by_kind = {k: median_abs(loso[r.row_id] for r in rows if k in row_kinds(r)) for k in kinds}
    held, held_layouts = choose_layouts(held, constants)
    held_errors = {r.row_id: signed_error(r, layout, constants) for r, layout in zip(held, held_layouts)}
    return Calibration(
        constants=constants,
        fitted_on=str(name or path),
        sha256=file_sha256(path),
        rows=tuple(r.row_id for r in rows),
        in_sample=median_abs(signed_error(r, layout, constants) for r, layout in zip(rows, chosen)),
        out_of_sample=median_abs(loso.values()),
        by_source=by_source,
        by_kind=by_kind,
        coverage=coverage(rows),
        row_errors={r.row_id: loso[r.row_id] for r in rows},
        held_out=held_errors,
        held_out_by_source={
            s: median_abs(held_errors[r.row_id] for r in held if r.source == s)
            for s in sorted({r.source for r in held})
        },
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Fit the planner's constants on published runs; write the calibration.")
    p.add_argument("csv", help="published runs (the columns of tests/data/published_runs.csv)")
    p.add_argument("--out", default=str(DEFAULT_PATH), help="calibration file to write (JSON)")
    ns = p.parse_args(argv)
    calibration = calibrate(ns.csv, verbose=True)
    save_calibration(calibration, ns.out)
    held = (
        f"; held out {calibration.held_out_median:.1f}% ({len(calibration.held_out)} rows, never fitted on)"
        if calibration.held_out
        else ""
    )
    print(
        f"in sample {calibration.in_sample:.1f}%, leave-one-source-out {calibration.out_of_sample:.1f}% "
        f"({', '.join(f'{k} {v:.1f}%' for k, v in calibration.by_kind.items())}){held}; wrote {ns.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
