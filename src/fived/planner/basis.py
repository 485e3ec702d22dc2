"""What a prediction rests on: which parts are calibrated on measured step times (and how far off
such predictions typically are out of sample), and which are extrapolated — and from what.

The calibration set's coverage is `fived.planner.calibration.COVERAGE` (checked against
tests/data/published_runs.csv by the tests); fived's own CPU step times are
benchmarks/bench_planner_cpu.py's (`fived.planner.hardware.CPU_MEDIAN_ERROR`).
"""
from __future__ import annotations

from fived.config import ModelConfig
from fived.layout.layout import Layout
from fived.planner.calibration import COVERAGE, OUT_OF_SAMPLE_ERROR
from fived.planner.hardware import CPU_MEDIAN_ERROR
from fived.planner.runtimes import Runtime
from fived.planner.timing import Cluster


def basis(model: ModelConfig, cluster: Cluster, runtime: Runtime, layout: Layout, seq_len: int) -> list[str]:
    """One line per part of the prediction: 'calibrated: ...' or 'extrapolated: ...'."""
    hw = cluster.hardware
    if hw.calibration == "cpu":
        lines = [f"calibrated: fived's step times on CPU ranks (benchmarks/bench_planner_cpu.py, median error "
                 f"{CPU_MEDIAN_ERROR:.0f}% over its layouts)"]
        if model.dim > 4096 or seq_len > 4096:
            lines.append("extrapolated: a model or sequence far larger than the benchmark's tiny ones")
        return lines
    runs = COVERAGE.get(hw.calibration, 0)
    if runs and hw.name.split("-")[0] in COVERAGE["gpus"]:
        lines = [f"calibrated: GEMM efficiency and link speeds fitted on {COVERAGE['rows']} published runs "
                 f"({runs} on {hw.calibration} GPUs); typical out-of-sample error {OUT_OF_SAMPLE_ERROR:.0f}% "
                 "(leave-one-source-out, `fived plan --validate`)"]
    else:
        lines = [f"extrapolated: no published run on {hw.name} (it takes the {hw.calibration} constants)"]
    if runtime.is_fived:
        kernels = "its compiled blocks priced as fused kernels" if runtime.fused else \
            "its eager element-wise kernels priced at HBM speed"
        lines.append("extrapolated: fived's own runtime on a GPU was never measured (no GPU was available): "
                     f"{kernels}, its GEMMs at the published runs' efficiency, its tp overlap (parallel.tp_overlap) "
                     "as hiding what Megatron-Core's --tp-comm-overlap hides")
    if model.is_moe:
        experts = "; fived runs a rank's experts as one grouped GEMM (CUDA, bf16)" if runtime.grouped_experts \
            else "; fived runs its experts in a loop, one kernel launch per expert GEMM"
        lines.append(f"{'calibrated' if COVERAGE['moe'] else 'extrapolated'}: mixture of experts "
                     f"({COVERAGE['moe']} MoE runs in the calibration set)" + (experts if runtime.is_fived else ""))
    if runtime.fp8:
        lines.append(f"{'calibrated' if COVERAGE['fp8'] else 'extrapolated'}: FP8 GEMMs ({COVERAGE['fp8']} FP8 runs)")
    if layout.cp > 1:
        ring = "fived's ring of fused attention blocks has no GPU measurement" if runtime.is_fived \
            else f"{COVERAGE['cp']} context-parallel runs in the calibration set"
        lines.append(f"{'calibrated' if COVERAGE['cp'] and not runtime.is_fived else 'extrapolated'}: context "
                     f"parallelism ({ring})")
    if seq_len > COVERAGE["max_seq"]:
        lines.append(f"extrapolated: sequence length {seq_len} beyond the calibration set's longest "
                     f"({COVERAGE['max_seq']})")
    if not layout.runnable:
        lines.append("not runnable by fived yet: experts split differently from the attention (MoE parallel folding)")
    return lines
