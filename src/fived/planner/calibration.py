"""Published training runs as planner inputs: `fived plan --validate FILE.csv`.

Each row of the calibration file (columns as in tests/data/published_runs.csv, copied from the
shared calibration set) states a model, a cluster, a layout and a measured throughput. A row becomes
a (model, layout, cluster, runtime) the planner predicts; the reported throughput is tokens/s per
GPU, taken from the row or, where only TFLOP/s or MFU is given, converted with the same model-FLOP
count the papers use (6 x matmul parameters + attention, no recomputation: `metrics.flops_per_token`).

Reading rules (each documented, none tuned to the result):
- GPT-style rows (GeLU MLP of width F, two matrices) become our SwiGLU block with the same matmul
  parameters: ffn_dim = 2F/3 rounded to a multiple of 8*tp. Missing kv_heads: multi-head attention.
  Missing ffn_hidden: 4 x hidden (the row's note says so).
- What a row does not state takes Megatron's default: no activation recomputation, no sequence
  parallelism and no distributed optimizer — except that --tp-comm-overlap implies sequence
  parallelism and --overlap-param-gather the distributed optimizer (ZeRO-1), as Megatron requires.
  Micro-batch size and virtual stages, which have no default, are the planner's choice: the fastest
  option that fits the GPU's memory (or the fastest, when the memory model — fived's, not the
  framework's — says none fits). Rows without a global batch (MFU only) are given 280 micro-batches
  per pipeline as their sibling rows in the same paper.
- The runtime: Megatron-LM 2021/2022 reduces gradients after backward in float32 and does not overlap
  tensor-parallel communication; Megatron-Core rows whose notes list --overlap-grad-reduce,
  --overlap-param-gather and --tp-comm-overlap overlap the dp reduction and MCORE_TP_OVERLAP of the tp
  communication.
"""
from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path

from fived.config import ConfigError, ModelConfig
from fived.metrics import flops_per_token
from fived.planner.hardware import hardware
from fived.mesh import Layout
from fived.planner.timing import Cluster, Runtime

MCORE_TP_OVERLAP = 0.75  # share of tp communication --tp-comm-overlap hides (fitted by `fit` below)


def framework_runtime(notes: str) -> Runtime:
    if "--tp-comm-overlap" in notes:  # Megatron-Core with every overlap switched on
        return Runtime(tp_overlap=MCORE_TP_OVERLAP, grad_overlap=True, zero12_overlap=True, pipeline_grad_overlap=True,
                       reduce_bytes=4, gather_bytes=2)
    return Runtime(tp_overlap=0.0, grad_overlap=False, zero12_overlap=False, pipeline_grad_overlap=False,
                   reduce_bytes=4, gather_bytes=2)  # Megatron-LM 2021/2022: reduce after backward, fp32
DEFAULT_MICROBATCHES = 280  # rows 19-20 (Korthikanti 2022, 530B at dp=8): as the paper's Table 3
REQUIRED = ("row_id", "num_layers", "hidden", "heads", "vocab", "seq_len", "gpu_type", "num_gpus",
            "gpus_per_node", "tp", "pp", "dp")


@dataclass
class Row:
    row_id: str
    source: str
    model: ModelConfig
    cluster: Cluster
    notes: str  # what the row says of its framework (decides the Runtime)
    seq_len: int
    global_batch: int  # sequences
    fixed: dict  # layout fields the row states
    open: dict  # layout fields it leaves to the planner: name -> candidate values
    reported: float  # tokens/s per GPU


def _int(value: str, default: int | None = None) -> int | None:
    value = (value or "").strip()
    return int(float(value)) if value else default


def _float(value: str) -> float | None:
    value = (value or "").strip()
    return float(value) if value else None


def read_rows(path: str | Path) -> list[Row]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--validate", str(path), "file not found", "give a CSV in the calibration file's columns")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError("--validate", str(path), "missing columns " + ", ".join(missing),
                              "use the columns of tests/data/published_runs.csv")
        return [_row(r) for r in reader]


def _row(r: dict) -> Row:
    tp, pp, dp = _int(r["tp"]), _int(r["pp"]), _int(r["dp"])
    cp, ep = _int(r.get("cp"), 1), _int(r.get("ep"), 1)
    hidden, heads = _int(r["hidden"]), _int(r["heads"])
    ffn = _int(r.get("ffn_hidden"), 4 * hidden)
    step = 8 * tp
    model = ModelConfig(name=r.get("model", ""), vocab_size=_int(r["vocab"]), dim=hidden, n_layers=_int(r["num_layers"]),
                        n_heads=heads, n_kv_heads=_int(r.get("kv_heads"), heads),
                        ffn_dim=max(step, round(2 * ffn / 3 / step) * step))
    seq = _int(r["seq_len"])
    fixed: dict = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
    open_: dict = {}
    notes = r.get("notes") or ""
    sp = (r.get("sp") or "").strip().lower()
    # Megatron's defaults where the row is silent; --tp-comm-overlap needs sequence parallelism and
    # --overlap-param-gather the distributed optimizer (ZeRO-1).
    fixed["sp"] = sp == "yes" if sp in ("yes", "no") else (tp > 1 and "--tp-comm-overlap" in notes)
    schedule = (r.get("pp_schedule") or "").lower()
    vpp = _int(r.get("vpp"))
    if pp > 1:
        if "interleaved" in schedule or (vpp or 1) > 1:
            fixed.update(pp_schedule="interleaved-1f1b", pp_virtual=vpp or 2)
        elif "1f1b" in schedule:
            fixed.update(pp_schedule="1f1b", pp_virtual=1)
        else:
            open_["pp_schedule"] = [("1f1b", 1)] + [("interleaved-1f1b", v) for v in (2, 3, 4)
                                                    if model.n_layers % (pp * v) == 0]
    recompute = (r.get("act_recompute") or "").lower()
    fixed["checkpointing"] = next((c for c in ("full", "selective") if recompute.startswith(c)), "none")
    zero = (r.get("zero_or_fsdp") or "").lower()
    fixed["zero"] = 1 if "distributed" in zero or (not zero and "--overlap-param-gather" in notes) else 0
    micro = _int(r.get("micro_batch"))
    global_batch = _int(r.get("global_batch_seqs")) or dp * DEFAULT_MICROBATCHES * (micro or 1)
    if micro:
        fixed["micro_batch"] = micro
    else:
        open_["micro_batch"] = [b for b in (1, 2, 4, 8) if (global_batch // dp) % b == 0]
    hw = hardware(r["gpu_type"])
    return Row(r["row_id"], r.get("source_short", ""), model, Cluster(hw, _int(r["num_gpus"]), _int(r["gpus_per_node"])),
               r.get("notes") or "", seq, global_batch, fixed, open_, _reported(r, model, seq))


def _reported(r: dict, model: ModelConfig, seq: int) -> float:
    for key in ("tokens_per_s_per_gpu", "derived_tokens_per_s_per_gpu"):
        if _float(r.get(key)):
            return _float(r[key])
    per_token = flops_per_token(model, seq)
    if _float(r.get("tflops_per_gpu")):
        return _float(r["tflops_per_gpu"]) * 1e12 / per_token
    if _float(r.get("mfu_pct")):
        return _float(r["mfu_pct"]) / 100 * _float(r["peak_dense_tflops_assumed"]) * 1e12 / per_token
    raise ConfigError(f"row {r['row_id']}", "", "no throughput (tokens/s, TFLOP/s or MFU)", "fill one of them")


def predict(row: Row):
    """The fastest completion of the row's layout that fits in memory — or, when the memory model
    says none fits (the run happened, so it did), the fastest completion (marked by `plan.fits`)."""
    from fived.planner.search import evaluate, expand

    runtime = framework_runtime(row.notes)
    plans = [evaluate(row.model, layout, row.cluster, row.seq_len, row.global_batch, runtime=runtime)
             for layout in expand(Layout(**row.fixed), row.open)]
    plans = [p for p in plans if p is not None]
    if not plans:
        raise ConfigError(f"row {row.row_id}", Layout(**row.fixed).describe(), "not a layout the runtime can run",
                          "check tp/pp/dp against the model's heads, layers and the global batch")
    return min(plans, key=lambda p: (not p.fits, p.time.total))


def validate(path: str | Path, printer=print) -> float:
    """Print predicted vs reported per row; return (and print last) the median absolute error in %."""
    errors = []
    printer(f"{'row':>4} {'source':<30} {'gpus':>5} {'layout (open fields: planner)':<58} {'reported':>9} "
            f"{'predicted':>9} {'error':>7}")
    for row in read_rows(path):
        plan = predict(row)
        got = plan.time.tokens_per_s_per_gpu
        err = (got - row.reported) / row.reported * 100
        errors.append(abs(err))
        mark = "" if plan.fits else "  (our memory model: does not fit)"
        printer(f"{row.row_id:>4} {row.source[:30]:<30} {row.cluster.gpus:>5} {plan.layout.describe()[:58]:<58} "
                f"{row.reported:>9.1f} {got:>9.1f} {err:>+6.1f}%{mark}")
    median = statistics.median(errors) if errors else float("nan")
    printer(f"median absolute error: {median:.1f}%")
    return median


def fit(path: str | Path) -> dict:
    """Re-derive the fitted constants: coordinate descent over a grid, minimising the median
    absolute error on `path`. `python -m fived.planner.calibration FILE.csv` prints the result; the
    constants in timing.py and here are what it printed on tests/data/published_runs.csv."""
    from fived.planner import timing

    rows = read_rows(path)
    grids = {"ampere": [0.40 + 0.025 * i for i in range(21)], "hopper": [0.40 + 0.025 * i for i in range(21)],
             "WIDTH_HALF": [0.0, 32.0, 64.0, 128.0, 256.0], "ROWS_HALF": [0.0, 64.0, 128.0, 256.0, 512.0],
             "LINK_EFFICIENCY": [0.6, 0.7, 0.8, 0.9],
             "MCORE_TP_OVERLAP": [0.0, 0.25, 0.5, 0.75, 1.0]}
    here = globals()

    def set_(name, value):
        if name in timing.EFFICIENCY:
            timing.EFFICIENCY[name] = value
        elif name == "MCORE_TP_OVERLAP":
            here[name] = value
        else:
            setattr(timing, name, value)
        timing.pipeline_profile.cache_clear()

    def error() -> float:
        return statistics.median(abs(predict(r).time.tokens_per_s_per_gpu / r.reported - 1) for r in rows)

    for _ in range(2):
        for name, grid in grids.items():
            scores = []
            for value in grid:
                set_(name, value)
                scores.append((error(), value))
            best = min(scores)
            set_(name, best[1])
            print(f"{name} = {best[1]:.3f}  (median error {best[0] * 100:.1f}%)", flush=True)
    return {"EFFICIENCY": dict(timing.EFFICIENCY), "WIDTH_HALF": timing.WIDTH_HALF, "ROWS_HALF": timing.ROWS_HALF,
            "LINK_EFFICIENCY": timing.LINK_EFFICIENCY, "MCORE_TP_OVERLAP": here["MCORE_TP_OVERLAP"]}


if __name__ == "__main__":  # python -m fived.planner.calibration tests/data/published_runs.csv
    import sys

    print(fit(sys.argv[1]))
