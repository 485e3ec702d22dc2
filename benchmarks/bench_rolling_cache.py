"""Rolling KV caches of windowed layers, measured: `fived generate`'s multi-rank generation
(`fived.tools.generate_ranks`, the path of `fived generate --nproc --report`) of tiny-gpt-oss (windows
of 8 on half its layers, sinks) with its rolling caches, and the same weights with the windows widened
past the sequence (every layer a global cache of every position: what generation held before).

Printed per case: the bytes the caches hold (their storage), what
`fived.planner.serve_model.kv_cache_bytes` (`fived plan --serve`'s formula) gives for the same shapes,
and the median time per output token over `--repeats` runs, each after one untimed generation. (The
ids the two cases generate differ: widening the window changes the model. The rolling cache's ids
are held to the full recompute and to transformers in tests/test_windows.py and
tests/test_hf_gpt_oss.py.) Other jobs sharing the cores slow single steps: check `uptime`.

    python benchmarks/bench_rolling_cache.py --prompt-len 64 --new-tokens 192
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")

from fived.config import model_preset
from fived.tools.generate import Sampling
from fived.tools.generate_ranks import generate_on_ranks, generation_config


def measure(model, prompts: list[list[int]], new_tokens: int, repeats: int) -> tuple[int, float, float]:
    """(cache bytes measured, the formula's bytes, median seconds per output token) on one rank."""
    cfg = generation_config(model, 1, dtype="float32")
    steps, kv, formula = [], 0, 0.0
    for _ in range(repeats):
        (report,) = generate_on_ranks(cfg, 1, prompts, Sampling(max_new_tokens=new_tokens), warmup=1)
        steps.append(statistics.median(report.decode_s))
        kv, formula = report.kv_bytes, report.kv_formula
    return kv, formula, statistics.median(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    rolling = model_preset("tiny-gpt-oss")
    positions = a.prompt_len + a.new_tokens
    cases = {
        f"rolling (window {rolling.sliding_window} on layers {rolling.window_pattern})": rolling,
        "every position (window widened past the sequence)": replace(rolling, sliding_window=positions + 1),
    }
    prompts = [[(7 * i + 3 * j) % 256 for j in range(a.prompt_len)] for i in range(a.batch)]
    print(f"tiny-gpt-oss, float32, 1 rank, {a.batch} prompts of {a.prompt_len} + {a.new_tokens} new tokens")
    for name, model in cases.items():
        kv, formula, step = measure(model, prompts, a.new_tokens, a.repeats)
        print(f"  {name}: KV cache {kv:,} bytes measured, {formula:,.0f} formula; {step * 1e3:.2f} ms per output token")


if __name__ == "__main__":
    main()
