"""What a prediction rests on: which parts are calibrated on measured step times (and how far off
such predictions typically are out of sample), and which are extrapolated — and from what.

Every figure quoted comes from a `fived.planner.constants.Calibration` (the shipped one unless one is
passed): what its calibration set covers and its leave-one-source-out errors, overall and for MoE and
FP8 runs, and its error on the sources held out of its fit; fived's own CPU step times are
benchmarks/bench_planner_cpu.py's (`fived.planner.hardware.CPU_MEDIAN_ERROR`).
"""

from __future__ import annotations

from fived.config import ModelConfig
from fived.layout.layout import Layout
from fived.planner.constants import CALIBRATION, Calibration
from fived.planner.hardware import CPU_MEDIAN_ERROR
from fived.planner.runtimes import Runtime
from fived.planner.timing import Cluster


def basis(
    model: ModelConfig,
    cluster: Cluster,
    runtime: Runtime,
    layout: Layout,
    seq_len: int,
    *,
    calibration: Calibration = CALIBRATION,
) -> list[str]:
    """One line per part of the prediction: 'calibrated: ...' or 'extrapolated: ...'."""
    hw, covered, kinds = cluster.hardware, calibration.coverage, calibration.by_kind
    if hw.profile:
        lines = [f"measured: machine profile {hw.profile.path} ({hw.profile.machine.get('device')}; fived calibrate)"]
        if hw.profile.collectives and cluster.gpus > hw.profile.nproc:
            lines.append(
                f"extrapolated: collectives and the ranks' sharing of the cores measured on {hw.profile.nproc} "
                f"ranks (fived calibrate --nproc {hw.profile.nproc}), priced here for {cluster.gpus}"
            )
    elif hw.calibration == "cpu":
        lines = [
            f"calibrated: fived's step times on CPU ranks (benchmarks/bench_planner_cpu.py, median error "
            f"{CPU_MEDIAN_ERROR:.0f}% over its layouts)"
        ]
    if hw.calibration == "cpu":
        if model.dim > 4096 or seq_len > 4096:
            lines.append("extrapolated: a model or sequence far larger than the benchmark's tiny ones")
        return lines
    if hw.profile:  # a GPU's profile: its compute measured; its links measured or the catalogue's
        if cluster.gpus > 1 and not hw.profile.collectives:
            lines.append("extrapolated: links are the catalogue's for this GPU (one GPU measured no collective)")
        lines.append(
            "extrapolated: fived's runtime priced by this GPU's measured GEMM, attention and element-wise "
            "rates, composed by the step-time model (docs/gpu.md: its error on one H200)"
        )
        return lines
    runs = covered.get(hw.calibration, 0)
    if runs and hw.name.split("-")[0] in covered["gpus"]:
        lines = [
            f"calibrated: GEMM efficiency and link speeds fitted on {covered['rows']} published runs "
            f"({runs} on {hw.calibration} GPUs); typical out-of-sample error {calibration.out_of_sample:.0f}% "
            f"(leave-one-source-out{_held_out(calibration)}, `fived plan --validate`)"
        ]
    else:
        lines = [f"extrapolated: no published run on {hw.name} (it takes the {hw.calibration} constants)"]
    if runtime.is_fived:
        kernels = (
            "its compiled blocks priced as fused kernels"
            if runtime.fused
            else "its eager element-wise kernels priced at HBM speed"
        )
        lines.append(
            "extrapolated: fived's own runtime was measured on one GPU only (an H200, a 1B model: docs/gpu.md), "
            "never across GPUs: "
            f"{kernels}, its GEMMs at the published runs' efficiency, its tp overlap (parallel.tp_overlap) "
            "as hiding what Megatron-Core's --tp-comm-overlap hides"
        )
    if model.is_moe:
        experts = (
            "; fived runs a rank's experts as one grouped GEMM (CUDA, bf16)"
            if runtime.grouped_experts
            else "; fived runs its experts in a loop, one kernel launch per expert GEMM"
        )
        lines.append(
            f"{'calibrated' if covered['moe'] else 'extrapolated'}: mixture of experts "
            f"({covered['moe']} MoE runs in the calibration set{_error(kinds, 'moe')})"
            + (experts if runtime.is_fived else "")
        )
    if runtime.fp8 and runtime.is_fived and not runtime.fused:
        lines.append(
            "FP8 GEMMs uncompiled (no train.compile with inductor): priced at the compute dtype's rate, and"
            " fived measured 0.49x bf16's tokens/s there (torchao's casts unfused; one H200)"
        )
    elif runtime.fp8:
        lines.append(
            f"{'calibrated' if covered['fp8'] else 'extrapolated'}: FP8 GEMMs ({covered['fp8']} FP8 runs"
            f"{_error(kinds, 'fp8')})"
        )
    if layout.cp > 1:
        ring = (
            "fived's ring of fused attention blocks has no GPU measurement"
            if runtime.is_fived
            else f"{covered['cp']} context-parallel runs in the calibration set"
        )
        lines.append(
            f"{'calibrated' if covered['cp'] and not runtime.is_fived else 'extrapolated'}: context "
            f"parallelism ({ring})"
        )
    if seq_len > covered["max_seq"]:
        lines.append(
            f"extrapolated: sequence length {seq_len} beyond the calibration set's longest ({covered['max_seq']})"
        )
    if not layout.runnable:
        # (fived runs experts split like the attention, etp 0, or folded whole, etp 1: not other etp)
        lines.append(
            f"not runnable by fived yet: experts split over etp={layout.etp} of tp={layout.tp} ranks "
            "(fived runs etp 0: split like the attention, or etp 1: folded, whole)"
        )
    return lines


def _held_out(calibration: Calibration) -> str:
    """The held-out rows' median error, where the calibration held rows out of its fit."""
    if not calibration.held_out:
        return ""
    return (
        f"; {calibration.held_out_median:.0f}% on {len(calibration.held_out)} runs of "
        f"{len(calibration.held_out_by_source)} sources held out of the fit"
    )


def _error(by_kind, kind: str) -> str:
    return f", out-of-sample error {by_kind[kind]:.0f}%" if kind in by_kind else ""
