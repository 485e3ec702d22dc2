"""FP8 against bf16: linear-layer GEMM throughput (forward + backward, torchao's Float8Linear against
nn.Linear) and a short training run's tokens/s through fived's trainer (`train.fp8`), each eager and
compiled. torchao's float8 casts and scales are separate kernels unless compiled: on an H200 eager FP8
trained at 0.49x bf16's tokens/s (docs/gpu.md), so the check judges the compiled runs.

On a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: H100 is 9.0) the FP8 figures are
real `torch._scaled_mm` GEMMs. Anywhere else torchao emulates FP8 (float8 rounding, high-precision
matmuls): the run still checks that FP8 trains, but its figures are labelled
"emulated; not a speed figure" (emulation is slower than bf16 by construction).

    python benchmarks/bench_fp8_gemm.py                  # CUDA if present, else CPU at small sizes
    python benchmarks/bench_fp8_gemm.py --device cpu

`fp8_check(device=...)` is the same measurement shaped as a benchmarks/gpu_acceptance.py check.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance_checks import SKIP, outcome

from fived.config import PRESETS, ModelConfig

# (tokens, in_features, out_features): Llama 3 8B's attention and feed-forward GEMMs at 8 x 1024 tokens
CUDA_SHAPES = [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)]
# (on CPU FP8 is emulated and bf16 GEMMs take slow kernels: the CPU sizes exercise the code, in seconds;
# at 1024 x 512 x 1536 and a dim-512 model the check took two minutes of the CPU smoke run)
CPU_SHAPES = [(256, 256, 256), (256, 256, 768)]
# the training comparison: Llama 3.2 1B's widths at 4 layers on CUDA; tiny at dim 128 on CPU
CUDA_TRAIN = ModelConfig(
    name="fp8-bench", vocab_size=32000, dim=2048, n_layers=4, n_heads=32, n_kv_heads=8, ffn_dim=8192
)
CPU_TRAIN = ModelConfig(name="fp8-bench-cpu", **dict(PRESETS["tiny"], dim=128, ffn_dim=384))
EMULATED = "emulated; not a speed figure"


def real_fp8(device: str) -> bool:
    from fived.parallel.fp8 import hardware_fp8

    return hardware_fp8(device)


def _timed(fn, *, device: str, steps: int, warmup: int) -> float:
    """Median seconds of fn() after warmup calls, synchronised with the device."""
    times = []
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def linear_tflops(
    tokens: int, k: int, n: int, *, recipe: str, device: str, backend: str = "", steps: int = 10, warmup: int = 3
) -> float:
    """Forward + backward TFLOP/s of one bias-free linear in bf16 ("none") or an FP8 recipe, compiled
    by `backend` when one is named."""
    from fived.parallel.fp8 import apply_fp8

    holder = torch.nn.ModuleDict({"linear": torch.nn.Linear(k, n, bias=False)}).to(device, torch.bfloat16)
    apply_fp8([holder], recipe, device_type=device)  # ("none": left as it is)
    linear = torch.compile(holder["linear"], backend=backend) if backend else holder["linear"]
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)

    def step():
        linear(x).backward(grad)

    seconds = _timed(step, device=device, steps=steps, warmup=warmup)
    return 3 * 2 * tokens * k * n / seconds / 1e12  # forward, input gradient, weight gradient


def train_tokens_per_s(
    model: ModelConfig, *, fp8: str, device: str, seq_len: int, batch: int, steps: int, warmup: int, backend: str = ""
) -> dict:
    """fived's trainer on one rank in bf16, with or without FP8 linears, eager or compiled by `backend`:
    median tokens/s and losses."""
    from acceptance_speed import speed_config

    from fived.launch.ranks import run_ranks
    from fived.training.trainer import run_training

    cfg = speed_config(
        model,
        device=device,
        dtype="bfloat16",
        seq_len=seq_len,
        batch=batch,
        steps=warmup + steps,
        compile_backend=backend,
    )
    cfg.train.fp8 = fp8
    records = run_ranks(1, run_training, cfg, False, False, False, device=device, deadline_s=900)[0].metrics
    step = statistics.median(r["step_time_s"] for r in records[warmup:])
    return {"tokens_per_s": seq_len * batch / step, "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"]}


RECIPES = ("none", "tensorwise", "rowwise")


def measure(device: str) -> dict:
    """Every figure of the comparison: GEMM TFLOP/s per shape and recipe, train tokens/s per recipe,
    each eager and compiled (inductor on CUDA; on CPU aot_eager, which traces without building C++)."""
    cuda = device == "cuda"
    shapes = CUDA_SHAPES if cuda else CPU_SHAPES
    model, seq_len, batch = (CUDA_TRAIN, 2048, 4) if cuda else (CPU_TRAIN, 64, 4)
    steps, warmup = (5, 2) if cuda else (3, 1)
    figures: dict = {"real_fp8": real_fp8(device)}
    for suffix, backend in (("", ""), ("_compiled", "inductor" if cuda else "aot_eager")):
        figures["gemm_tflops" + suffix] = {
            f"{t}x{k}x{n}": {r: linear_tflops(t, k, n, recipe=r, device=device, backend=backend) for r in RECIPES}
            for t, k, n in shapes
        }
        figures["train" + suffix] = {
            r: train_tokens_per_s(
                model, fp8=r, device=device, seq_len=seq_len, batch=batch, steps=steps, warmup=warmup, backend=backend
            )
            for r in RECIPES
        }
    return figures


def fp8_check(*, device: str) -> dict:
    """For benchmarks/gpu_acceptance.py: FP8 trains, eager and compiled (finite losses, within 5% of
    bf16's last loss) and, on FP8 hardware, the largest compiled FP8 GEMM and the compiled FP8 training
    run outrun compiled bf16's (eager FP8's unfused casts make it slower: its figures are reported, not
    judged). Emulated elsewhere: figures are not speeds."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return {"status": SKIP, "figures": {}, "note": "torchao is not installed (pip install 'fived[fp8]')"}
    figures = measure(device)
    trains = all(
        math.isfinite(t["loss_last"])
        and abs(t["loss_last"] - runs["none"]["loss_last"]) <= 0.05 * runs["none"]["loss_last"]
        for runs in (figures["train"], figures["train_compiled"])
        for t in runs.values()
    )
    if not figures["real_fp8"]:
        return outcome(trains, figures, f"FP8 {EMULATED}")
    gemm = figures["gemm_tflops_compiled"][next(iter(figures["gemm_tflops_compiled"]))]
    run = figures["train_compiled"]
    faster = (
        max(gemm["tensorwise"], gemm["rowwise"]) > gemm["none"]
        and max(run["tensorwise"]["tokens_per_s"], run["rowwise"]["tokens_per_s"]) > run["none"]["tokens_per_s"]
    )
    return outcome(trains and faster, figures, "real FP8 GEMMs (torch._scaled_mm), compiled FP8 against compiled bf16")


def print_report(figures: dict, device: str) -> None:
    label = "" if figures["real_fp8"] else f"  ({EMULATED})"
    print(f"FP8 vs bf16 on {device}{label}")
    for suffix, how in (("", "eager"), ("_compiled", "compiled")):
        print(
            f"{'linear fwd+bwd, ' + how + ' (tokens x in x out)':>46}  {'bf16':>8}  {'tensorwise':>10}  {'rowwise':>8}  TFLOP/s"
        )
        for shape, row in figures["gemm_tflops" + suffix].items():
            print(f"{shape:>46}  {row['none']:8.3g}  {row['tensorwise']:10.3g}  {row['rowwise']:8.3g}")
        print(f"{'train (fived, bf16 weights), ' + how:>46}  {'tokens/s':>8}  {'first loss':>10}  {'last loss':>9}")
        for recipe, t in figures["train" + suffix].items():
            print(f"{recipe:>46}  {t['tokens_per_s']:8.0f}  {t['loss_first']:10.4f}  {t['loss_last']:9.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    print_report(measure(args.device), args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
