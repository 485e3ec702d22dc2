"""The planner's calibration as data: the constants the step-time model takes from measured runs,
with the provenance of the fit that chose them.

`Calibration` is one frozen object: the `Constants`, the file and rows they were fitted on (with
the file's SHA-256, so a stale calibration is detectable), the fit's in-sample and
leave-one-source-out errors (over all rows, per source, per kind of row, per row), what the
calibration set covers, and the errors of the file's held-out rows (its `split` "test" rows: never
fitted on, predicted with the final constants only to report them). `fived.planner.fitting` writes it (atomically) as JSON;
`load_calibration` reads it back (plain JSON, never a pickle) and refuses a file with unknown or
missing fields in one line. `CALIBRATION` is the file shipped next to this module
(src/fived/planner/calibration.json): the planner prices with its constants and quotes its errors
(`fived.planner.basis`). Nothing rewrites it at run time: a refit is a new file, loaded as a new
object and passed explicitly (`timing.step_time(..., constants=...)`).

`Constants()`'s defaults are the priors the fitter starts from (each commented with where it comes
from); a constant no row of the fitted set depends on keeps its prior.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fived.config import ConfigError
from fived.planner.layout_cache import kept_hash, state_without_kept_hash

FORMAT = 1
DEFAULT_PATH = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class Constants:
    """What the step-time model takes from measurements (fitted unless said otherwise)."""

    efficiency_ampere: float = 0.7  # share of dense peak wide GEMMs reach, A100/A800 (prior: cuBLAS ~70-80%)
    efficiency_hopper: float = 0.6  # H100/H200/H800 (prior: cuBLAS reaches a lower share of Hopper's peak)
    width_half: float = 256.0  # per-GPU hidden width (dim/tp) at which GEMM efficiency halves
    rows_half: float = 128.0  # tokens per GEMM (a micro-batch's, or an expert's) at which it halves (assumed,
    #   not fitted: the published runs' GEMMs all have thousands of tokens, so they cannot tell it)
    depth_half: float = 0.0  # the GEMMs' full side (the hidden) at which it halves (prior 0: no effect)
    link_efficiency: float = 0.8  # share of link bandwidth ring collectives reach (prior: NCCL tests 0.75-0.9)
    ring_step_latency_s: float = 0.0  # per step of a ring collective across nodes (NCCL's ring: n-1 steps)
    cross_node_rails: float = 1.0  # NICs' worth of bandwidth a ring reaches across nodes when its group has
    #   several ranks per node (prior 1: each rank its own NIC's share; up to the ranks per node)
    tp_overlap: float = 0.5  # share of tp communication Megatron-Core's --tp-comm-overlap hides
    fp8_speedup: float = 1.4  # FP8 GEMM speed-up over BF16 at the same shapes, casts included
    expert_efficiency: float = 0.6  # routed experts' share of a dense GEMM's efficiency at the same shapes
    #   (prior: the figure fived shipped before this calibration; routing's memory traffic is priced apart,
    #   timing.DISPATCH_BYTES)

    __hash__ = kept_hash
    __getstate__ = state_without_kept_hash

    def gemm_efficiency(self, generation: str) -> float:
        """The wide-GEMM share of peak for a GPU generation ("ampere", "hopper")."""
        return getattr(self, f"efficiency_{generation}")


@dataclass(frozen=True)
class Calibration:
    constants: Constants
    fitted_on: str  # the CSV the fitter read, as it was named (tests/data/published_runs.csv)
    sha256: str  # of that file's bytes when fitted
    rows: tuple[str, ...]  # the row ids the constants were fitted on
    in_sample: float  # median absolute error of those rows with these constants, %
    out_of_sample: float  # leave-one-source-out median absolute error over the same rows, %
    by_source: Mapping[str, float] = field(default_factory=dict)  # leave-one-source-out median per source, %
    by_kind: Mapping[str, float] = field(default_factory=dict)  # ... per kind (dense, moe, fp8), %
    coverage: Mapping[str, Any] = field(default_factory=dict)  # rows per GPU generation, MoE, FP8, CP...
    row_errors: Mapping[str, float] = field(default_factory=dict)  # row id -> leave-one-source-out
    #   predicted/reported - 1 (what validation ranks sweeps by, out of sample)
    held_out: Mapping[str, float] = field(default_factory=dict)  # held-out row id -> predicted/reported - 1
    #   with these constants (rows the fit never read)
    held_out_by_source: Mapping[str, float] = field(default_factory=dict)  # their median per source, %

    @property
    def held_out_median(self) -> float:
        """Median absolute error of the held-out rows, % (nan without any)."""
        errors = [abs(e) for e in self.held_out.values()]
        return statistics.median(errors) * 100 if errors else float("nan")

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "constants": asdict(self.constants),
            "fitted_on": self.fitted_on,
            "sha256": self.sha256,
            "rows": list(self.rows),
            "in_sample": round(self.in_sample, 4),
            "out_of_sample": round(self.out_of_sample, 4),
            "by_source": {k: round(v, 4) for k, v in self.by_source.items()},
            "by_kind": {k: round(v, 4) for k, v in self.by_kind.items()},
            "coverage": dict(self.coverage),
            "row_errors": {k: round(v, 6) for k, v in self.row_errors.items()},
            "held_out": {k: round(v, 6) for k, v in self.held_out.items()},
            "held_out_by_source": {k: round(v, 4) for k, v in self.held_out_by_source.items()},
        }


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_calibration(path: str | Path = DEFAULT_PATH) -> Calibration:
    """The calibration a fit wrote to `path` (JSON); one-line ConfigError for a file that is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            "calibration",
            str(path),
            f"not a readable calibration file ({e.__class__.__name__})",
            "write one with python -m fived.planner.fitting FILE.csv --out PATH",
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError("calibration", str(path), f"not calibration format {FORMAT}", "refit it")
    known = {f.name for f in fields(Calibration)} | {"format"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{path}: {unknown[0]}", data[unknown[0]], "unknown calibration field", ", ".join(sorted(known))
        )
    constant_names = {f.name for f in fields(Constants)}
    given = data.get("constants") or {}
    if set(given) != constant_names:
        missing = sorted(constant_names ^ set(given))
        raise ConfigError(
            f"{path}: constants", missing[0], "missing or unknown constant", ", ".join(sorted(constant_names))
        )
    try:
        return Calibration(
            constants=Constants(**{k: float(v) for k, v in given.items()}),
            fitted_on=str(data["fitted_on"]),
            sha256=str(data["sha256"]),
            rows=tuple(str(r) for r in data["rows"]),
            in_sample=float(data["in_sample"]),
            out_of_sample=float(data["out_of_sample"]),
            by_source=MappingProxyType({str(k): float(v) for k, v in data.get("by_source", {}).items()}),
            by_kind=MappingProxyType({str(k): float(v) for k, v in data.get("by_kind", {}).items()}),
            coverage=MappingProxyType(dict(data.get("coverage", {}))),
            row_errors=MappingProxyType({str(k): float(v) for k, v in data.get("row_errors", {}).items()}),
            held_out=MappingProxyType({str(k): float(v) for k, v in data.get("held_out", {}).items()}),
            held_out_by_source=MappingProxyType(
                {str(k): float(v) for k, v in data.get("held_out_by_source", {}).items()}
            ),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError("calibration", str(path), f"malformed ({e})", "refit it") from None


def save_calibration(calibration: Calibration, path: str | Path) -> None:
    """Write `calibration` to `path` atomically (fived.files: never over a file that is not a calibration)."""
    from fived.files import write_output

    # one field a line (a refit's diff reads field by field)
    fields_ = calibration.to_json()
    text = "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in fields_.items()) + "\n}\n"
    write_output(path, text, "--out", _is_calibration)


def _is_calibration(path: Path) -> bool:
    data = json.loads(Path(path).read_text())  # (fived.files: a ValueError is "not ours")
    return isinstance(data, dict) and "fitted_on" in data and "constants" in data


CALIBRATION = load_calibration()
