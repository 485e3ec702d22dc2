"""`fived plan --serve --validate FILE.csv`: the serving planner's prediction of each published serving
benchmark (tests/data/published_serving.csv: engine, model, GPUs, tp/pp/ep, weights, workload, the
metric and its value, and the exact place it was published), the error per row and the median.

A row's metric is predicted by `fived.planner.serve` for its layout and workload:
  e2e_latency_ms          a static batch generated to the end (`Replica.static_batch_s`: vLLM's
                          latency benchmark)
  output_tokens_per_s     the cluster's output tokens/s with `concurrency` requests queued (closed
                          loop: the maximum-load throughput benchmarks)
  ttft_ms / tpot_ms       mean time to first token / per output token at `concurrency` requests in flight
  tokens_per_s_per_user   output tokens over one request's generation time (batch 1)
Nothing is fitted on these rows: they test the forward-time model and the queueing model as built.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass

from fived.config import ConfigError, model_preset
from fived.planner.hardware import hardware
from fived.planner.serve import Replica, Workload, evaluate
from fived.planner.serve_model import ServeLayout, sequences_that_fit
from fived.planner.timing import Cluster

METRICS = ("e2e_latency_ms", "output_tokens_per_s", "ttft_ms", "tpot_ms", "tokens_per_s_per_user")
GPUS_PER_NODE = 8


@dataclass
class Row:
    number: int
    values: dict

    def int(self, key: str, default: int = 0) -> int:
        text = (self.values.get(key) or "").strip()
        return int(text) if text else default


def read_rows(path: str) -> list[Row]:
    try:
        with open(path, newline="") as f:
            return [Row(i, row) for i, row in enumerate(csv.DictReader(f), 1)]
    except OSError as e:
        raise ConfigError(
            "--validate", path, f"cannot be read ({e.strerror})", "give a CSV of published serving runs"
        ) from None


def predict(row: Row) -> float:
    """The planner's figure for the row's metric."""
    v = row.values
    m = model_preset(v["model"])
    gpus, tp, pp, ep = row.int("gpus"), row.int("tp", 1), row.int("pp", 1), row.int("ep", 1)
    cluster = Cluster(hardware(v["gpu"]), gpus, min(GPUS_PER_NODE, gpus))
    layout = ServeLayout(tp=tp, pp=pp, dp=gpus // (tp * pp), ep=ep, weights=v["weights"])
    w = Workload(
        row.int("prompt_len"),
        row.int("output_len"),
        concurrency=row.int("concurrency"),
        kv_dtype=v["kv_dtype"] or "bf16",
    )
    metric = v["metric"]
    if metric in ("e2e_latency_ms", "tokens_per_s_per_user"):
        capacity = int(cluster.hardware.memory_gib * 2**30)
        fit = sequences_that_fit(
            m,
            layout,
            cluster.hardware,
            capacity,
            positions=w.positions,
            forward_tokens=w.prompt_len,
            kv_bytes=w.kv_bytes,
        )
        seconds = Replica(m, layout, cluster, w, fit).static_batch_s(row.int("batch", 1))
        return seconds * 1e3 if metric == "e2e_latency_ms" else w.output_len / seconds
    plan = evaluate(m, layout, cluster, w)
    return {"output_tokens_per_s": plan.throughput, "ttft_ms": plan.at.ttft_s * 1e3, "tpot_ms": plan.at.tpot_s * 1e3}[
        metric
    ]


def validation(path: str) -> tuple[list[tuple[Row, float, float]], list[str]]:
    """([(row, published, predicted)], skipped-row lines): a row that cannot be used gets one line."""
    out, skipped = [], []
    for row in read_rows(path):
        metric = row.values.get("metric", "")
        try:
            if metric not in METRICS:
                raise ValueError(f"unknown metric {metric!r} (known: {', '.join(METRICS)})")
            out.append((row, float(row.values["value"]), predict(row)))
        except (ConfigError, ValueError, KeyError, ZeroDivisionError) as e:
            skipped.append(f"row {row.number} skipped: {e}")
    return out, skipped


def optimistic(row: Row, published: float, predicted: float) -> bool:
    """The prediction is better than the published figure (a latency lower, a throughput higher)."""
    return (predicted > published) == (row.values["metric"] in ("output_tokens_per_s", "tokens_per_s_per_user"))


def median_error(results: list[tuple[Row, float, float]]) -> float:
    return statistics.median(abs(predicted / published - 1) * 100 for _, published, predicted in results)


def validate(path: str) -> float:
    """Print every row's published and predicted figure and the median absolute error; return it."""
    results, skipped = validation(path)
    print(
        f"{'row':>3}  {'source':<28} {'model':<13} {'gpu':<15} {'layout':<14} {'workload':<18} {'metric':<22} "
        f"{'published':>10} {'fived':>10} {'error':>7}"
    )
    for row, published, predicted in results:
        v = row.values
        layout = f"tp{v['tp']} pp{v['pp']} {v['weights']}"
        load = f"{v['prompt_len']}/{v['output_len']} " + (
            f"b{v['batch']}" if v.get("batch") else f"c{v['concurrency']}"
        )
        print(
            f"{row.number:>3}  {v['source']:<28} {v['model']:<13} {v['gpu']:<15} {layout:<14} {load:<18} "
            f"{v['metric']:<22} {published:>10.4g} {predicted:>10.4g} {(predicted / published - 1) * 100:>+6.1f}%"
        )
    for line in skipped:
        print(line)
    if not results:
        print("no row predicted")
        return float("nan")
    per_source: dict[str, list] = {}
    for r in results:
        per_source.setdefault(r[0].values["source"], []).append(r)
    print(
        "median absolute error per source: " + ", ".join(f"{s} {median_error(rs):.1f}%" for s, rs in per_source.items())
    )
    error = median_error(results)
    print(
        f"predicted {len(results)} of {len(results) + len(skipped)} rows; faster than published (lower latency, higher "
        f"throughput) in {sum(1 for r in results if optimistic(*r))} of them"
    )
    print(f"median absolute error: {error:.1f}%")
    return error
