"""GPU acceptance in one command: on one CUDA GPU, in well under 20 minutes, it checks and reports
these (without CUDA it prints one line and exits 0; --device cpu runs the plumbing at tiny sizes):

1. training steps of `tiny` and `tiny-moe` through fived's trainer on CUDA against the same steps on
   CPU (float32; same seed, data and layout);
2. the fused ring's CUDA flash attention blocks and the `torch._grouped_mm` experts (bf16) against
   their float64 reference paths, forward and backward;
3. a ~1B Llama (Llama 3.2 1B's shapes) at seq 4096 in bf16: tokens/s, MFU and peak memory of fived
   (eager and compiled) against Hugging Face transformers' LlamaForCausalLM (eager and compiled);
4. the planner's predicted step time and memory for fived's eager run, next to the measured ones;
5. a checkpoint's save/load round trip and `fived generate` on CUDA;
6. FP8 linears (train.fp8, torchao) against bf16: GEMM TFLOP/s and training tokens/s
   (benchmarks/bench_fp8_gemm.py; SKIP without torchao; emulated, not a speed figure, without FP8 hardware).

Each check runs guarded (a failure is that check's FAIL; the others still run). It writes
gpu_acceptance.json and gpu_acceptance.md (in --out, default the current directory), prints a final
summary line, and exits 1 if any check failed. Without CUDA it prints one line and exits 0.
`--device cpu` is the opt-in smoke run: the same checks at tiny sizes on CPU in float32 (seconds),
with what needs CUDA marked SKIP, so that the script itself is tested where there is no GPU.

    pip install -c constraints.txt -e '.[bench]'     # transformers
    python benchmarks/gpu_acceptance.py               # one CUDA GPU
    python benchmarks/gpu_acceptance.py --out reports/
    python benchmarks/gpu_acceptance.py --device cpu  # smoke run on CPU
    python benchmarks/gpu_acceptance.py --skip compiled   # (--only/--skip: checks whose name contains it)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import acceptance_checks as checks
import acceptance_speed as speed
import bench_fp8_gemm as fp8
import torch

from fived.config import PRESETS, ConfigError, ModelConfig
from fived.files import check_output, starts_with, write_output

TIME_BUDGET_S = 20 * 60
# Llama 3.2 1B's shapes (1.24B parameters, tied embeddings; its rope scaling left out: no cost).
LLAMA_1B = ModelConfig(
    name="llama-1b",
    vocab_size=128256,
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=8192,
    rope_theta=500000.0,
    tie_embeddings=True,
)


@dataclass(frozen=True)
class Profile:
    """What one run measures: the GPU run, or the CPU smoke run's small stand-ins."""

    device: str
    kernel_dtype: torch.dtype  # the fused kernels' dtype (bf16 paths need CUDA)
    speed_model: ModelConfig
    speed_dtype: str  # fived's train.dtype; transformers' parameters get the same compute dtype
    seq_len: int
    batch: int
    steps: int  # timed
    warmup: int  # untimed, compilation included
    compile_backend: str  # inductor on CUDA; the CPU smoke run traces only (aot_eager: no C++ build)


GPU = Profile(
    "cuda", torch.bfloat16, LLAMA_1B, "bfloat16", seq_len=4096, batch=2, steps=10, warmup=3, compile_backend="inductor"
)
SMOKE = Profile(
    "cpu",
    torch.float32,
    ModelConfig(name="smoke", **dict(PRESETS["tiny"], n_layers=2)),
    "float32",
    seq_len=64,
    batch=2,
    steps=2,
    warmup=1,
    compile_backend="aot_eager",
)


def plan_checks(p: Profile, run_dir: str, results: dict) -> list[tuple[str, object]]:
    """(name, zero-argument check) in running order; `results` holds earlier checks' outcomes. The
    training comparisons come first: their CPU runs fork from this process, which must not have
    started CUDA yet (the CUDA runs are spawned; the kernel checks start CUDA here)."""
    shapes = dict(device=p.device, dtype=p.speed_dtype, seq_len=p.seq_len, batch=p.batch)
    timing = dict(shapes, steps=p.steps, warmup=p.warmup)
    size = f"{p.speed_model.name}, seq {p.seq_len}"
    return [
        ("train tiny: device vs cpu", lambda: checks.training_matches_cpu("tiny", device=p.device)),
        ("train tiny-moe: device vs cpu", lambda: checks.training_matches_cpu("tiny-moe", device=p.device)),
        ("step breakdown adds up", lambda: checks.breakdown_adds_up(device=p.device)),
        (
            "ring attention blocks vs reference",
            lambda: checks.ring_blocks_match_reference(device=p.device, dtype=p.kernel_dtype),
        ),
        ("grouped experts vs loop", lambda: checks.grouped_experts_match_loop(device=p.device, dtype=p.kernel_dtype)),
        (f"speed: fived eager ({size})", lambda: speed.fived_speed(p.speed_model, **timing)),
        (
            f"speed: fived compiled ({size})",
            lambda: speed.fived_speed(p.speed_model, **timing, compile_backend=p.compile_backend),
        ),
        (f"speed: transformers eager ({size})", lambda: speed.hf_speed(p.speed_model, **timing)),
        (
            f"speed: transformers compiled ({size})",
            lambda: speed.hf_speed(p.speed_model, **timing, compile_backend=p.compile_backend),
        ),
        (
            "planner vs measured (fived eager)",
            lambda: speed.planner_vs_measured(p.speed_model, results.get(f"speed: fived eager ({size})"), **shapes),
        ),
        ("checkpoint round trip", lambda: checks.checkpoint_round_trip(run_dir, device=p.device)),
        ("fived generate: device vs cpu", lambda: checks.generate_matches_cpu(run_dir, device=p.device)),
        ("fp8 vs bf16 (torchao)", lambda: fp8.fp8_check(device=p.device)),
    ]


def run_guarded(name: str, check) -> dict:
    """One check; an exception is its FAIL (traceback to stderr), never the run's end."""
    print(f"[gpu_acceptance] {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        result = check()
    except Exception as e:  # (every failure is reported the same way: it is a FAIL of this check)
        traceback.print_exc()
        first_line = (str(e).splitlines() or [""])[0]
        result = {"status": checks.FAIL, "figures": {}, "note": f"{type(e).__name__}: {first_line}"}
    result = {"name": name, **result, "seconds": time.perf_counter() - start}
    print(
        f"[gpu_acceptance] {result['status']} {name} ({result['seconds']:.1f} s) {result['note']}",
        file=sys.stderr,
        flush=True,
    )
    return result


def chosen(name: str, only: list[str], skip: list[str]) -> bool:
    """--only / --skip: a check runs if its name contains one of `only` (or `only` is empty) and none of `skip`."""
    return (not only or any(o in name for o in only)) and not any(s in name for s in skip)


def run_all(p: Profile, *, only: list[str] = (), skip: list[str] = ()) -> list[dict]:
    results: dict[str, dict] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fived-acceptance-") as run_dir:
        for name, check in plan_checks(p, run_dir, results):
            if chosen(name, list(only), list(skip)):
                results[name] = run_guarded(name, check)
            else:
                results[name] = {
                    "name": name,
                    "status": checks.SKIP,
                    "figures": {},
                    "note": "--only/--skip",
                    "seconds": 0.0,
                }
    total = time.perf_counter() - start
    budget = {
        "name": "whole run within 20 minutes",
        "status": checks.PASS if total <= TIME_BUDGET_S else checks.FAIL,
        "figures": {"total_s": total, "budget_s": TIME_BUDGET_S},
        "note": "",
        "seconds": 0.0,
    }
    return [*results.values(), budget]


def device_name(p: Profile) -> str:
    return torch.cuda.get_device_name() if p.device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"


def summary_line(results: list[dict], p: Profile) -> str:
    counts = {s: sum(r["status"] == s for r in results) for s in (checks.PASS, checks.FAIL, checks.SKIP)}
    total = next(r["figures"]["total_s"] for r in results if r["name"] == "whole run within 20 minutes")
    verdict = "ACCEPTED" if counts[checks.FAIL] == 0 else "NOT ACCEPTED"
    return (
        f"gpu_acceptance: {verdict}: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP "
        f"on {device_name(p)} in {total / 60:.1f} min"
    )


def _figure(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_figure(v)}" for k, v in value.items()) + "}"
    return str(value)


def speed_table(results: list[dict]) -> list[str]:
    rows = [r for r in results if r["name"].startswith("speed:") and r["status"] == checks.PASS]
    if not rows:
        return []
    baseline = next(
        (r["figures"]["tokens_per_s"] for r in rows if r["name"].startswith("speed: transformers eager")), None
    )
    lines = [
        "| runtime | tokens/s | vs transformers eager | MFU | step s | peak GiB | warmup s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r["figures"]
        peak = "n/a (CPU)" if f["peak_memory_gib"] is None else f"{f['peak_memory_gib']:.2f}"
        ratio = f"{f['tokens_per_s'] / baseline:.2f}x" if baseline else "n/a"
        lines.append(
            f"| {r['name'][7:]} | {f['tokens_per_s']:.0f} | {ratio} | {f['mfu']:.1%} | {f['step_s']:.4g} | "
            f"{peak} | {f['warmup_s']:.1f} |"
        )
    return ["## Speed", "", *lines, ""]


def markdown(results: list[dict], p: Profile, header: dict) -> str:
    lines = [
        f"# GPU acceptance: {header['device']}",
        "",
        f"torch {header['torch']}, {header['date']}, profile `{p.device}`",
        "",
        "| check | status | seconds | note |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['name']} | **{r['status']}** | {r['seconds']:.1f} | {r['note']} |" for r in results]
    lines += ["", *speed_table(results), "## Figures", ""]
    for r in results:
        lines += [f"### {r['name']}: {r['status']}", ""]
        lines += [f"- {k}: {_figure(v)}" for k, v in r["figures"].items()] + [""]
    return "\n".join(lines + [header["summary"], ""])


def write_reports(results: list[dict], p: Profile, out: Path, stem: str) -> tuple[Path, Path]:
    header = {
        "device": device_name(p),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "summary": summary_line(results, p),
    }
    profile = {k: str(v) if isinstance(v, torch.dtype) else v for k, v in asdict(p).items()}
    json_path, md_path = report_paths(out, stem)
    doc = {"report": "gpu_acceptance", **header, "profile": profile, "checks": results}
    write_output(json_path, json.dumps(doc, indent=1, default=str) + "\n", "--out", OURS[".json"])
    write_output(md_path, markdown(results, p, header), "--out", OURS[".md"])
    return json_path, md_path


# how each report is known as this script's (fived.files replaces only those)
OURS = {".json": starts_with(b'"report": "gpu_acceptance"'), ".md": starts_with(b"# GPU acceptance:")}


def report_paths(out: Path, stem: str) -> tuple[Path, Path]:
    """The two reports' paths, each checked before anything runs: never over a file this did not write."""
    return check_output(out / f"{stem}.json", "--out", OURS[".json"]), check_output(
        out / f"{stem}.md", "--out", OURS[".md"]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default): the acceptance run; cpu: the smoke run at tiny sizes",
    )
    parser.add_argument("--out", default=".", help="directory of the reports (default: the current one)")
    parser.add_argument("--name", default="gpu_acceptance", help="the reports' file name without suffix")
    parser.add_argument("--only", action="append", default=[], help="run the checks whose name contains this")
    parser.add_argument("--skip", action="append", default=[], help="skip the checks whose name contains this")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_acceptance: CUDA is absent on this machine; nothing was measured (--device cpu runs the smoke checks)"
        )
        return 0
    profile = GPU if args.device == "cuda" else SMOKE
    try:
        report_paths(Path(args.out), args.name)
    except ConfigError as e:  # (one line, nothing run)
        print(f"gpu_acceptance: {e}", file=sys.stderr)
        return 2
    results = run_all(profile, only=args.only, skip=args.skip)
    json_path, md_path = write_reports(results, profile, Path(args.out), args.name)
    print(f"reports: {json_path} {md_path}")
    print(summary_line(results, profile))
    return 0 if all(r["status"] != checks.FAIL for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
