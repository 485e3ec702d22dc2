"""The serving planner against fived's measured generation on CPU ranks: prefill time and time per output
token, predicted vs measured, per layout and batch size.

Each case runs `fived.tools.generate_ranks` (the multi-rank generation of `fived generate --nproc`: training's
tensor, pipeline and expert parallel modules, KV caches) on fresh gloo ranks, one thread each, `--repeats`
times after one untimed generation in the same ranks; a case's measured prefill is the median over repeats of the last pipeline stage's prefill (the
barrier before the prompt to its first tokens), its time per output token the median over repeats of
the median decode step. The planner predicts both with `fived.planner.serve_model.forward_time` on
`fived.planner.hardware.local_hardware` (this host's CPU constants, as `fived plan` uses for CPU ranks):
the prefill as one forward of the rank's whole batch (fived's runtime prefills every prompt at once),
a decode step at the rank's batch and the mean context. Printed: each case, and the median absolute
error of each quantity and of both. Other jobs sharing the cores slow single steps: check `uptime`.

    python benchmarks/bench_serve_cpu.py                # 8 cases, 3 repeats
    python benchmarks/bench_serve_cpu.py --save serve.json --fit   # and refit the CPU forward overhead

--fit refits `fived.planner.hardware.DISPATCH_CPU_S` (the host's dispatch per operator of a forward
without autograd, the only constant the serving model adds for CPU ranks) on these measurements by a grid
search on the median absolute error of both quantities, and prints it with the leave-one-case-out error
(each case predicted with the value fitted without it). What hardware.py holds is what it printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")

from fived.config import model_preset
from fived.planner.hardware import DISPATCH_CPU_S, local_hardware
from fived.planner.serve_model import ServeLayout, forward_time
from fived.planner.timing import Cluster
from fived.tools.generate import Sampling
from fived.tools.generate_ranks import generate_on_ranks, generation_config

# (model, world, tp, pp, ep, prompts in the batch): every dimension generation runs, batch 1 to 8
CASES = [
    ("tiny", 1, 1, 1, 1, 1),
    ("tiny", 1, 1, 1, 1, 8),
    ("tiny", 2, 2, 1, 1, 4),
    ("tiny", 4, 4, 1, 1, 4),
    ("tiny", 2, 1, 2, 1, 4),
    ("tiny", 2, 1, 1, 1, 8),  # two data-parallel replicas, 4 prompts each
    ("tiny-moe", 1, 1, 1, 1, 4),
    ("tiny-moe", 2, 1, 1, 2, 4),  # ep2 over two data-parallel ranks
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--fit", action="store_true", help="refit the CPU dispatch per operator on the measurements")
    p.add_argument("--save", metavar="FILE.json", help="write the measurements to FILE")
    p.add_argument("--load", metavar="FILE.json", help="use measurements saved by --save instead of measuring")
    return p.parse_args()


def measure(case, args) -> tuple[float, float]:
    """(prefill seconds, seconds per output token) of one case, medians over repeats."""
    model, world, tp, pp, ep, batch = case
    cfg = generation_config(model_preset(model), world, tp=tp, pp=pp, ep=ep, dtype="float32")
    cfg.train.device = "cpu"
    prompts = [[(7 * i + j) % 256 for j in range(args.prompt_len)] for i in range(batch)]
    prefill, step = [], []
    for _ in range(args.repeats):
        reports = generate_on_ranks(cfg, world, prompts, Sampling(max_new_tokens=args.new_tokens), warmup=1)
        last = [r for r in reports if r.generated is not None]
        prefill.append(max(r.prefill_s for r in last))
        step.append(max(statistics.median(r.decode_s) for r in last))
    return statistics.median(prefill), statistics.median(step)


def predict(case, args, overhead_s: float = DISPATCH_CPU_S) -> tuple[float, float]:
    """(prefill seconds, seconds per output token) the serving model predicts, with `overhead_s` as the
    CPU's dispatch per operator (before local_hardware divides it by the ranks' core share)."""
    model, world, tp, pp, ep, batch = case
    m = model_preset(model)
    layout = ServeLayout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep, weights="float32")  # as the ranks run
    hw = local_hardware(world)
    hw = replace(hw, dispatch_s=overhead_s / hw.core_share)
    per_rank = batch // layout.dp
    kv = 4  # float32 caches
    cluster = Cluster(hw, world, world)
    prefill = forward_time(
        m, layout, cluster, sequences=per_rank, new_tokens=args.prompt_len, context=args.prompt_len, kv_bytes=kv
    )
    step = forward_time(
        m, layout, cluster, sequences=per_rank, new_tokens=1, context=args.prompt_len + args.new_tokens / 2, kv_bytes=kv
    )
    return prefill.total, step.total


def errors(cases, measured, args, overhead_s: float) -> list[tuple[float, float]]:
    """Signed % errors (prefill, per token) of each case."""
    out = []
    for case, meas in zip(cases, measured):
        pred = predict(case, args, overhead_s)
        out.append(tuple((p / m - 1) * 100 for m, p in zip(meas, pred)))
    return out


def median_abs(errs) -> float:
    return statistics.median(abs(e) for pair in errs for e in pair)


def fit(cases, measured, args) -> float:
    """The dispatch per operator (seconds) minimising the median absolute error of both quantities."""
    grid = [i * 1e-7 for i in range(201)]
    return min(grid, key=lambda x: (median_abs(errors(cases, measured, args, x)), x))


def main() -> None:
    args = parse_args()
    if args.load:
        with open(args.load) as f:
            measured = [tuple(m) for m in json.load(f)["measured"]]
    else:
        measured = [measure(case, args) for case in CASES]
    if args.save:
        with open(args.save, "w") as f:
            json.dump(
                {"cases": CASES, "measured": measured, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}, f
            )
    print(
        f"{'case':<36} {'prefill ms measured':>20} {'predicted':>10} {'error':>7}   "
        f"{'ms/token measured':>18} {'predicted':>10} {'error':>7}"
    )
    errs = errors(CASES, measured, args, DISPATCH_CPU_S)
    for case, meas, e in zip(CASES, measured, errs):
        model, world, tp, pp, ep, batch = case
        pred = predict(case, args)
        name = f"{model} tp{tp} pp{pp} dp{world // (tp * pp)} ep{ep} batch {batch}"
        print(
            f"{name:<36} {meas[0] * 1e3:>20.2f} {pred[0] * 1e3:>10.2f} {e[0]:>+6.1f}%   "
            f"{meas[1] * 1e3:>18.2f} {pred[1] * 1e3:>10.2f} {e[1]:>+6.1f}%"
        )
    print(
        f"median absolute error: prefill {statistics.median(abs(e[0]) for e in errs):.1f}%, time per output "
        f"token {statistics.median(abs(e[1]) for e in errs):.1f}%, both {median_abs(errs):.1f}% over {len(CASES)} cases"
    )
    if args.fit:
        best = fit(CASES, measured, args)
        held = [
            errors([c], [m], args, fit(CASES[:i] + CASES[i + 1 :], measured[:i] + measured[i + 1 :], args))[0]
            for i, (c, m) in enumerate(zip(CASES, measured))
        ]
        print(
            f"fit: DISPATCH_CPU_S = {best:.2e} (in sample {median_abs(errors(CASES, measured, args, best)):.1f}%, "
            f"leave-one-case-out {median_abs(held):.1f}%)"
        )


if __name__ == "__main__":
    main()
