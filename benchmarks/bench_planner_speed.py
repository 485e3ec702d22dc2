"""How fast the planner answers: CPU seconds of `fived plan`'s search for llama3-70b on 512 H100
(docs/training.md's command) and of pricing a sample of `fived explore`'s layouts for mixtral-8x7b
on 128 H100 (tests/test_pages.py's arguments), each in a fresh process so no cache is warm.

    python benchmarks/bench_planner_speed.py              # both, 3 runs each, the least CPU time kept
    python benchmarks/bench_planner_speed.py --runs 1 --sample 2000

CPU time (`time.process_time`), not wall: other jobs sharing the cores stretch wall time far more.
The sample is every k-th reachable layout (`fived.tools.explore.reachable_layouts`), priced with
`fived.tools.explore.price`; the figure printed for explore is the whole page's estimate at that rate.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

PLAN = "llama3-70b", 512, 8192, 512  # model, GPUs, sequence, global batch (sequences)
EXPLORE = "mixtral-8x7b", 128, 4096, 256


def plan_seconds() -> float:
    from fived.config import model_preset
    from fived.planner.hardware import hardware
    from fived.planner.search import plan
    from fived.planner.timing import Cluster

    name, gpus, seq, batch = PLAN
    start = time.process_time()
    search = plan(model_preset(name), Cluster(hardware("h100"), gpus, 8), seq, batch, headroom_gib=3.0, keep=5)
    seconds = time.process_time() - start
    print(f"plan {name}/{gpus}: {search.considered} considered, {search.fitting} fit", file=sys.stderr)
    return seconds


def explore_seconds(sample: int) -> tuple[float, int, int]:
    """(CPU seconds, layouts priced, reachable layouts in all) over every k-th reachable layout."""
    from fived.config import model_preset
    from fived.planner.hardware import hardware
    from fived.planner.timing import Cluster
    from fived.tools.explore import price, reachable_layouts, toggle_options

    name, gpus, seq, batch = EXPLORE
    model, cluster = model_preset(name), Cluster(hardware("h100"), gpus, 8)
    options = toggle_options(model, cluster, seq, batch)
    layouts = [x for _, x in reachable_layouts(options, cluster) if not isinstance(x, str)]
    step = max(1, len(layouts) // sample)
    chosen = layouts[::step]
    start = time.process_time()
    for layout in chosen:
        price(model, layout, cluster, seq, batch, "bfloat16", 3.0)
    return time.process_time() - start, len(chosen), len(layouts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sample", type=int, default=5000, help="explore layouts priced (default 5000)")
    parser.add_argument("--child", choices=("plan", "explore"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child == "plan":
        print(plan_seconds())
        return
    if ns.child == "explore":
        print(*explore_seconds(ns.sample))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def child(kind: str) -> list[float]:
        argv = [sys.executable, __file__, "--child", kind, "--sample", str(ns.sample)]
        out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
        return [float(x) for x in out.split()]

    plans = [child("plan")[0] for _ in range(ns.runs)]
    explores = [child("explore") for _ in range(ns.runs)]
    seconds, priced, reachable = min(explores)
    priced, reachable = int(priced), int(reachable)
    load = os.getloadavg()[0]
    print(f"fived plan {PLAN[0]}/{PLAN[1]}: {min(plans):.2f} s CPU (least of {ns.runs}; load {load:.1f})")
    print(
        f"fived explore {EXPLORE[0]}/{EXPLORE[1]}: {seconds / priced * 1e3:.3f} ms CPU a layout over {priced} of "
        f"{reachable:,} -> ~{seconds / priced * reachable:.0f} s for the page's pricing"
    )


if __name__ == "__main__":
    main()
