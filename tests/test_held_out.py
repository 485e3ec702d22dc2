"""The frozen test split of the published runs: rows whose `split` is "test" are never read by a fit,
only predicted with its final constants and reported apart (`fived plan --validate`, `fived plan`'s
basis)."""

import csv
from pathlib import Path

import pytest

from fived.planner.calibration import validate
from fived.planner.constants import CALIBRATION, load_calibration, save_calibration
from fived.planner.fitting import calibrate
from fived.planner.published import read_runs

CALIBRATION_FILE = Path(__file__).parent / "data" / "published_runs.csv"
# a small calibration set: two sources to fit (so leave-one-source-out runs), one held out; layouts
# the rows state whole (no open field: a fit prices one layout per row)
FIT_ROWS, HELD_ROWS = ("1", "2", "42", "43"), ("11", "12")


def _small_set(path: Path, *, held_throughput: float = 1.0, extra: tuple[dict, ...] = ()) -> Path:
    """FIT_ROWS and HELD_ROWS of the calibration file (the held-out ones with split "test" and their
    throughput scaled by `held_throughput`), and `extra` rows."""
    reported = {r.row_id: r.reported for r in read_runs(CALIBRATION_FILE)[0]}
    with CALIBRATION_FILE.open(newline="") as f:
        records = {r["row_id"]: r for r in csv.DictReader(f)}
    rows = [dict(records[i], split="fit") for i in FIT_ROWS]
    rows += [
        dict(records[i], split="test", tokens_per_s_per_gpu=f"{reported[i] * held_throughput:.3f}") for i in HELD_ROWS
    ]
    rows += [dict(records[FIT_ROWS[0]], **e) for e in extra]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(fit on the small set, fit on it with the held-out rows' throughput tenfold and a row of an
    unknown split, that file)."""
    tmp = tmp_path_factory.mktemp("held_out")
    corrupted = _small_set(tmp / "corrupted.csv", held_throughput=10.0, extra=({"row_id": "typo", "split": "tset"},))
    return calibrate(_small_set(tmp / "clean.csv")), calibrate(corrupted), corrupted


def test_the_fit_never_reads_the_held_out_rows(small):
    """Their measured throughput corrupted tenfold, the fit is the same to the last digit (constants,
    rows, in-sample and leave-one-source-out errors); only the held-out errors, reported after the
    fit, follow the corruption. A split that is neither fit nor test is refused, never fitted on."""
    clean, corrupted, path = small
    assert corrupted.constants == clean.constants
    assert corrupted.rows == clean.rows == FIT_ROWS
    assert (corrupted.in_sample, corrupted.out_of_sample) == (clean.in_sample, clean.out_of_sample)
    assert dict(corrupted.row_errors) == dict(clean.row_errors) and dict(corrupted.by_source) == dict(clean.by_source)
    assert set(clean.held_out) == set(HELD_ROWS) and set(clean.held_out_by_source) == {"Korthikanti2022"}
    for row in HELD_ROWS:  # (predicted the same, against a tenth of the throughput: the errors are read)
        assert 1 + corrupted.held_out[row] == pytest.approx((1 + clean.held_out[row]) / 10)
    assert "row typo skipped: split='tset': fit or test" in read_runs(path)[1]


def test_validate_reports_the_held_out_rows_apart(small, tmp_path):
    """`fived plan --validate`: the held-out rows marked per row, left out of the in-sample and
    leave-one-source-out figures, with their own median and every one of them 2x off named."""
    _, corrupted, path = small
    save_calibration(corrupted, tmp_path / "small.json")
    fitted = load_calibration(tmp_path / "small.json")
    lines: list[str] = []
    result = validate(path, printer=lines.append, calibration=fitted)
    for row in HELD_ROWS:  # (its notes open with it)
        assert any(x.split()[0] == row and "%  held out" in x for x in lines)
    assert result["held_out"] == pytest.approx(fitted.held_out_median, abs=1e-3) and result["held_out_rows"] == 2
    assert sorted(result["held_out_twice_off"]) == sorted(HELD_ROWS)  # (a tenth: 2x off, and named)
    assert next(x for x in lines if x.startswith("2x off or more held out")).startswith(
        "2x off or more held out: 2 of 2 rows ("
    )
    assert f"held out: median {fitted.held_out_median:.1f}%, 2 rows of 1 sources, 2 rows 2x off or more" in lines
    assert next(x for x in lines if x.startswith("2x off or more in sample")).endswith(f"of {len(FIT_ROWS)} rows")
    assert result["median"] == pytest.approx(fitted.in_sample, abs=1e-3)
    assert result["loso"] == pytest.approx(fitted.out_of_sample, abs=1e-3)
    assert set(result["loso_by_source"]) == {"Narayanan2021-SC21", "InternLM-7B-2023"}
    with path.open(newline="") as f:  # a file of held-out rows only: no in-sample figure, never nan
        held_only = [r for r in csv.DictReader(f) if r["split"] == "test"]
    (tmp_path / "held.csv").write_text(",".join(held_only[0]) + "\n")
    with (tmp_path / "held.csv").open("a", newline="") as f:
        csv.DictWriter(f, fieldnames=list(held_only[0])).writerows(held_only)
    lines = []
    validate(tmp_path / "held.csv", printer=lines.append, calibration=fitted)
    assert lines[-1] == "median absolute error: no row to fit (every row predicted is held out)"
    assert not any("in sample" in x or "nan" in x for x in lines)


def test_the_shipped_calibration_holds_the_test_split_out():
    """The calibration file's test split (its `split` column) is what the shipped calibration held
    out: none of its rows fitted on, each with its reported error."""
    rows, _ = read_runs(CALIBRATION_FILE)
    held = {r.row_id for r in rows if r.held_out}
    assert held and set(CALIBRATION.held_out) == held and not held & set(CALIBRATION.rows)
    assert set(CALIBRATION.rows) | held == {r.row_id for r in rows}
    assert set(CALIBRATION.held_out_by_source) == {r.source for r in rows if r.held_out}
    assert not {r.source for r in rows if r.held_out} & set(CALIBRATION.by_source)  # whole sources held out
