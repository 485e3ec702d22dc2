"""`fived plan --validate FILE.csv`: the planner against published training runs — per row, per
kind of run, per sweep of layouts — in sample and out of sample.

Per row: the prediction (`fived.planner.fitting.predict`, priced with the shipped calibration's
constants) against what the row reports, with the planner-chosen fields and any derivation noted.
Then: how many runs the memory model says fit; **sweeps** — every group of rows of one source with
the same model, GPU type and count, sequence length and precision that ran several layouts — each
with the Spearman correlation of predicted vs measured throughput and the measured throughput of
the planner's top-ranked row as a share of the best measured one (the choice a user would make);
the **held-out** rows (split "test": rows no fit reads, priced with the calibration's constants)
per source and over all of them; the **leave-one-source-out** error of the fitting split (constants
refitted without a source predict it) per source, per kind of run (dense, MoE, FP8) and over all its
rows; last the in-sample median of the fitting split. Every row 2x off (or half) is named, in
sample, held out and out of sample.

Out of sample: for the file the shipped calibration was fitted on (same SHA-256), its stored
leave-one-source-out errors (`fived.planner.constants.CALIBRATION`; the tests recompute them);
for any other file, a refit per source here (`fived.planner.fitting.leave_one_source_out`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from fived.layout.layout import Layout
from fived.planner.constants import CALIBRATION, Calibration, file_sha256
from fived.planner.fitting import batch, leave_one_source_out, median_abs, predict
from fived.planner.published import Row, read_runs, row_kinds
from fived.planner.validity import layout_refusal


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks); nan when either side is constant."""
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else float("nan")


def sweeps(rows: list[Row], layouts: list[Layout]) -> dict[str, list[int]]:
    """Label -> indices of rows of one source, model, GPU type and count, sequence and precision that
    ran at least two different layouts (or batch sizes)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(r.source, r.model.name, r.cluster.hardware.name, r.cluster.gpus, r.seq_len, r.runtime.fp8)].append(i)
    out = {}
    for (source, model, gpu, gpus, _, fp8), members in groups.items():
        if len({(layouts[i].describe(), rows[i].global_batch) for i in members}) > 1:
            out[f"{source[:18]} {model[:24]} {gpus}x{gpu}{' fp8' if fp8 else ''}"] = members
    return out


def rank_quality(measured: list[float], predicted: list[float]) -> tuple[float, float]:
    """(Spearman of predicted vs measured, measured throughput of the predicted best / the best)."""
    top = max(range(len(predicted)), key=lambda i: predicted[i])
    return spearman(predicted, measured), measured[top] / max(measured)


def _plan_notes(row: Row, plan) -> list[str]:
    """What the prediction of `row` assumed beyond the reading: memory, fived's rules, the batch."""
    notes = [] if plan.fits else ["our memory model: does not fit"]
    priced = batch(row, plan.layout)
    if row.global_batch and priced != row.global_batch:
        notes.append(f"priced at a global batch of {priced} (the schedule's whole rounds)")
    if not plan.layout.runnable:
        notes.append("not runnable by fived yet")
    elif (refusal := layout_refusal(row.model, plan.layout, row.seq_len, priced)) is not None:
        notes.append(f"outside fived's rules ({refusal.rule})")
    return notes


def twice_off(errors: dict[str, float]) -> list[str]:
    """The row ids whose prediction is 2x the reported figure or more, or half of it or less."""
    return [row for row, e in errors.items() if e >= 1.0 or e <= -0.5]


def _twice_off(label: str, errors: dict[str, float]) -> str:
    """One line: how many rows are 2x off, each with its error, the worst first."""
    off = [(row, errors[row]) for row in twice_off(errors)]
    listed = ", ".join(f"{row} {e * 100:+.0f}%" for row, e in sorted(off, key=lambda x: -abs(x[1])))
    return f"2x off or more {label}: {len(off)} of {len(errors)} rows" + (f" ({listed})" if off else "")


def _print_rows(rows, plans, printer) -> None:
    printer(
        f"{'row':>4} {'source':<26} {'gpus':>5} {'layout (planner-chosen fields: see notes)':<54} {'reported':>9} "
        f"{'predicted':>9} {'error':>7}  notes"
    )
    for row, plan in zip(rows, plans):
        notes = (["held out"] if row.held_out else []) + row.notes + _plan_notes(row, plan)
        err = plan.time.tokens_per_s_per_gpu / row.reported - 1
        printer(
            f"{row.row_id:>4} {row.source[:26]:<26} {row.cluster.gpus:>5} {plan.layout.describe()[:54]:<54} "
            f"{row.reported:>9.1f} {plan.time.tokens_per_s_per_gpu:>9.1f} {err * 100:>+6.1f}%  {'; '.join(notes)}"
        )


def _print_sweeps(rows, layouts, predicted, out_of_sample, printer) -> list[dict]:
    """One line per sweep: rows, Spearman and top pick in sample (and out of sample when known)."""
    out = []
    groups = sweeps(rows, layouts)
    if groups:
        printer(
            "sweeps (one model on one cluster, several layouts): Spearman of predicted vs measured, the "
            "planner's top pick's measured throughput / the best measured"
            + (" — in sample | out of sample" if out_of_sample else "")
        )
    for label, members in groups.items():
        measured = [rows[i].reported for i in members]
        rho, top = rank_quality(measured, [predicted[i] for i in members])
        entry = {"group": label, "rows": [rows[i].row_id for i in members], "spearman": rho, "top": top}
        line = f"  {label:<56} {len(members):>2} rows  Spearman {rho:+.2f}  top pick {top:.2f}"
        if out_of_sample:
            held = [rows[i].reported * (1 + out_of_sample[rows[i].row_id]) for i in members]
            entry["spearman_loso"], entry["top_loso"] = rank_quality(measured, held)
            line += f"  |  Spearman {entry['spearman_loso']:+.2f}  top pick {entry['top_loso']:.2f}"
        printer(line)
        out.append(entry)
    return out


def validate(
    path: str | Path,
    printer=print,
    out_of_sample: bool = True,
    calibration: Calibration = CALIBRATION,
    refit: bool = False,
) -> dict:
    """Print predicted vs reported per row, the skipped rows, the memory model's fit, the sweeps'
    ranking, the held-out rows' errors, the leave-one-source-out error of the fitting split per
    source and kind and over all its rows and, last, the in-sample median absolute error of the
    fitting split. Returns the figures printed. `refit`: recompute the out-of-sample errors even for
    the file `calibration` was fitted on."""
    rows, skipped = read_runs(path)
    planned = [(row, predict(row, calibration.constants)) for row in rows]
    for row, plan in planned:
        if plan is None:
            skipped.append(
                f"row {row.row_id} skipped: no completion of {Layout(**row.fixed).describe()} is a layout "
                "the planner can cost"
            )
    done = [(row, plan) for row, plan in planned if plan is not None]
    rows, plans = [r for r, _ in done], [p for _, p in done]
    _print_rows(rows, plans, printer)
    for line in skipped:
        printer(line)
    errors = {r.row_id: p.time.tokens_per_s_per_gpu / r.reported - 1 for r, p in done}
    fitting = [i for i, r in enumerate(rows) if not r.held_out]  # the rows a fit may read
    if fitting:
        printer(_twice_off("in sample", {rows[i].row_id: errors[rows[i].row_id] for i in fitting}))
    fits = sum(p.fits for p in plans)
    result: dict[str, Any] = {
        "rows": len(rows) + len(skipped),
        "predicted": len(rows),
        "fits": fits,
        "median": median_abs(errors[rows[i].row_id] for i in fitting),
    }
    printer(
        f"memory: {fits} of {len(rows)} published runs fit in the planner's memory model "
        f"({fits / max(len(rows), 1):.0%})"
    )
    loso = (
        _out_of_sample(
            path, [rows[i] for i in fitting], [plans[i].layout for i in fitting], calibration, printer, refit
        )
        if out_of_sample and len({rows[i].source for i in fitting}) > 1
        else {}
    )
    held = {r.row_id: errors[r.row_id] for r in rows if r.held_out}
    result["sweeps"] = _print_sweeps(
        rows,
        [p.layout for p in plans],
        [p.time.tokens_per_s_per_gpu for p in plans],
        {**loso, **held} if loso else {},
        printer,
    )
    if held:
        result.update(_print_held_out([r for r in rows if r.held_out], held, printer))
    if loso:
        result.update(_print_loso([rows[i] for i in fitting], loso, printer))
    printer(f"predicted {len(rows)} of {result['rows']} rows")
    printer(
        f"median absolute error: {result['median']:.1f}%"
        if fitting
        else "median absolute error: no row to fit (every row predicted is held out)"
    )
    return result


def _print_held_out(rows: list[Row], errors: dict[str, float], printer) -> dict:
    """The held-out rows (split "test": no fit reads them), priced with the calibration's constants:
    every row 2x off, the median per source and over all of them."""
    by_source = {
        s: median_abs(errors[r.row_id] for r in rows if r.source == s) for s in sorted({r.source for r in rows})
    }
    printer(_twice_off("held out", errors))
    printer(
        "held out (split test: sources no fit reads, priced with the calibration's constants): "
        + ", ".join(f"{s} {v:.1f}%" for s, v in by_source.items())
    )
    median = median_abs(errors.values())
    printer(
        f"held out: median {median:.1f}%, {len(rows)} rows of {len(by_source)} sources, "
        f"{len(twice_off(errors))} rows 2x off or more"
    )
    return {
        "held_out": median,
        "held_out_rows": len(rows),
        "held_out_by_source": by_source,
        "held_out_twice_off": twice_off(errors),
    }


def _print_loso(rows: list[Row], loso: dict[str, float], printer) -> dict:
    """Leave-one-source-out over the fitting split: every row 2x off, per source, per kind, overall."""
    result: dict[str, Any] = {
        "loso_by_source": {
            s: median_abs(loso[r.row_id] for r in rows if r.source == s) for s in sorted({r.source for r in rows})
        },
        "loso_by_kind": {
            k: median_abs(loso[r.row_id] for r in rows if k in row_kinds(r))
            for k in sorted({k for r in rows for k in row_kinds(r)})
        },
        "loso": median_abs(loso.values()),
    }
    printer(_twice_off("out of sample", loso))
    printer(
        "leave-one-source-out (constants fitted without the source): "
        + ", ".join(f"{s} {v:.1f}%" for s, v in result["loso_by_source"].items())
    )
    printer(
        "leave-one-source-out by kind: "
        + ", ".join(
            f"{k} {v:.1f}% ({sum(k in row_kinds(r) for r in rows)} rows)" for k, v in result["loso_by_kind"].items()
        )
    )
    printer(f"leave-one-source-out median absolute error: {result['loso']:.1f}%")
    return result


def _out_of_sample(
    path, rows: list[Row], layouts: list[Layout], calibration: Calibration, printer, refit: bool
) -> dict[str, float]:
    """Row id -> leave-one-source-out signed error: the calibration's own when it was fitted on this
    very file, else refitted here."""
    if (
        not refit
        and file_sha256(path) == calibration.sha256
        and set(calibration.row_errors) == {r.row_id for r in rows}
    ):
        printer(f"out of sample: as fitted on this file ({calibration.fitted_on}, the shipped calibration)")
        return dict(calibration.row_errors)
    return leave_one_source_out(rows, layouts)
