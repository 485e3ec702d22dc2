"""`fived plan --serve` and `fived explore --serve`: the serving planner's flags, checked one line per
bad value before any pricing; every figure comes from `fived.planner.serve`."""

from __future__ import annotations

import argparse
import json
import math
import shlex

from fived.config import ConfigError
from fived.errors import NOT_GIVEN

TRAINING_BATCH_TOKENS = 4 * 2**20  # the training comparison's default batch: Llama 3's initial 4M tokens
TRAINING_MIN_SEQ = 4096  # and at least its initial sequence length (the serving context, rounded up, if longer)


def add_serve_flags(parser) -> None:
    parser.add_argument(
        "--serve",
        action="store_true",
        help="plan serving instead of training: rank tp x pp x "
        "replicas (x ep, bf16/fp8 weights) by output tokens/s within the latency targets",
    )
    parser.add_argument("--prompt-len", type=int, help="--serve: prompt tokens of every request (fixed)")
    parser.add_argument("--output-len", type=int, help="--serve: output tokens of every request (fixed)")
    parser.add_argument("--rate", type=float, help="--serve: requests/s arriving (Poisson)")
    parser.add_argument("--concurrency", type=int, help="--serve: requests in flight (each sent when one ends)")
    parser.add_argument("--ttft-ms", type=float, help="--serve: p99 time-to-first-token target")
    parser.add_argument("--tpot-ms", type=float, help="--serve: p99 time-per-output-token target")
    parser.add_argument("--weights", default="bf16,fp8", help="--serve: weight dtypes to consider (default bf16,fp8)")
    parser.add_argument(
        "--kv-dtype",
        default="bf16",
        help="--serve: KV cache dtype: bf16 (default), fp8, or float32 / "
        "float64 (what `fived generate` runs in on CPU)",
    )


def workload_from(ns: argparse.Namespace):
    from fived.layout.bounds import INTEGER_BOUNDS
    from fived.planner.serve import Workload
    from fived.planner.serve_model import KV_DTYPES

    longest = next(high for name, _, high, _ in INTEGER_BOUNDS if name == "train.seq_len")  # (a context)
    for flag, value in (("--prompt-len", ns.prompt_len), ("--output-len", ns.output_len)):
        if value is None or not 1 <= value <= longest:
            raise ConfigError(flag, value, f"required with --serve, in 1..{longest}", f"e.g. {flag} 2048")
    if ns.rate is not None and ns.concurrency is not None:
        raise ConfigError("--rate", ns.rate, "give --rate or --concurrency, not both", "drop one")
    for flag, value, example in (
        ("--rate", ns.rate, "2"),
        ("--concurrency", ns.concurrency, "64"),
        ("--ttft-ms", ns.ttft_ms, "2000"),
        ("--tpot-ms", ns.tpot_ms, "50"),
    ):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(flag, value, "must be > 0", f"e.g. {flag} {example}")
    if ns.kv_dtype not in KV_DTYPES:
        raise ConfigError("--kv-dtype", ns.kv_dtype, "must be one of " + ", ".join(KV_DTYPES), "e.g. --kv-dtype bf16")
    return Workload(
        ns.prompt_len,
        ns.output_len,
        rate=ns.rate or 0.0,
        concurrency=ns.concurrency or 0,
        ttft_s=ns.ttft_ms / 1e3 if ns.ttft_ms else math.inf,
        tpot_s=ns.tpot_ms / 1e3 if ns.tpot_ms else math.inf,
        kv_dtype=ns.kv_dtype,
    )


def serve_cluster(ns: argparse.Namespace, plan_model):
    """The model (`plan_model(name)`: a preset, TOML, run or Hugging Face directory) and the cluster."""
    from fived.planner.hardware import hardware
    from fived.planner.timing import Cluster

    if getattr(ns, "machine", None):  # (accepted by `fived plan`'s parser, read by its training plans only)
        raise ConfigError(
            "--machine",
            ns.machine,
            "not read by --serve: a serving plan prices the catalogue's GPU (--gpu); a machine profile prices "
            "training plans",
            "drop --machine",
        )
    if ns.model is None or ns.gpus is None:
        raise ConfigError(
            "--model" if ns.model is None else "--gpus",
            NOT_GIVEN,
            "required",
            "fived plan --serve --model llama3-70b --gpus 8 --gpu h100 --prompt-len 2048 --output-len 256",
        )
    for flag, value in (("--gpus", ns.gpus), ("--gpus-per-node", ns.gpus_per_node)):
        if value < 1:
            raise ConfigError(flag, value, "must be >= 1", f"e.g. {flag} 8")
    return plan_model(ns.model), Cluster(hardware(ns.gpu), ns.gpus, min(ns.gpus_per_node, ns.gpus))


def weight_choices(ns: argparse.Namespace) -> tuple[str, ...]:
    from fived.planner.serve_model import SERVING_WEIGHTS

    chosen = tuple(w.strip() for w in ns.weights.split(",") if w.strip())
    bad = [w for w in chosen if w not in SERVING_WEIGHTS]
    if bad or not chosen:
        raise ConfigError("--weights", ns.weights, "must list bf16 and/or fp8", "e.g. --weights bf16,fp8")
    return chosen


def serve_layout(model, spec: str, gpus: int):
    """`--layout '--tp 4 --pp 1 --ep 1 --weights fp8'` with --serve (dp: what the GPUs leave)."""
    from fived.planner.serve import serving_refusal
    from fived.planner.serve_model import ServeLayout

    parser = argparse.ArgumentParser(prog="--layout", add_help=False, exit_on_error=False)
    for flag in ("--tp", "--pp", "--ep"):
        parser.add_argument(flag, type=int, default=1)
    parser.add_argument("--weights", default="bf16")
    try:
        values, unknown = parser.parse_known_args(shlex.split(spec))
    except argparse.ArgumentError as e:
        raise ConfigError("--layout", spec, str(e), "e.g. --layout '--tp 4 --weights fp8'") from None
    if unknown:
        raise ConfigError(
            "--layout",
            spec,
            f"unknown {unknown[0]} (with --serve: --tp, --pp, --ep, --weights)",
            "e.g. --layout '--tp 4 --weights fp8'",
        )
    if values.tp < 1 or values.pp < 1 or gpus % (values.tp * values.pp):
        raise ConfigError("--layout", spec, f"tp*pp must divide --gpus {gpus}", "e.g. --layout '--tp 2'")
    layout = ServeLayout(
        tp=values.tp, pp=values.pp, dp=gpus // (values.tp * values.pp), ep=values.ep, weights=values.weights
    )
    reason = serving_refusal(model, layout)
    if reason is not None:
        raise reason
    return layout


def training_shape(ns: argparse.Namespace, w) -> tuple[int, int]:
    """(seq, global batch in sequences) of the training comparison."""
    seq = ns.seq or max(TRAINING_MIN_SEQ, 1 << (w.positions - 1).bit_length())
    tokens = ns.global_batch_tokens or TRAINING_BATCH_TOKENS
    if tokens % seq:
        raise ConfigError(
            "--global-batch-tokens", tokens, f"must be a multiple of --seq {seq}", f"e.g. {max(1, tokens // seq) * seq}"
        )
    return seq, tokens // seq


def cmd_plan_serve(ns: argparse.Namespace, plan_model) -> int:
    from fived.planner import serve, serve_explain

    if ns.validate:
        from fived.planner.serve_validation import validate

        validate(ns.validate)
        return 0
    w = workload_from(ns)
    model, cluster = serve_cluster(ns, plan_model)
    if ns.memory_headroom < 0 or ns.memory_headroom >= cluster.hardware.memory_gib:
        raise ConfigError(
            "--memory-headroom", ns.memory_headroom, f"must be in [0, {cluster.hardware.memory_gib:g})", "e.g. 3"
        )
    if ns.layout:
        plans = [serve.evaluate(model, serve_layout(model, ns.layout, cluster.gpus), cluster, w, ns.memory_headroom)]
        train = None
    else:
        plans = serve.plan_serving(model, cluster, w, weight_choices(ns), ns.memory_headroom)
        train = serve_explain.training_view(model, cluster, *training_shape(ns, w), ns.memory_headroom)
    if ns.json:
        print(json.dumps(serve_explain.to_json(plans, model, cluster, w, ns.top, ns.model, train), indent=1))
    else:
        print(serve_explain.report(plans, model, cluster, w, ns.top, ns.model, train))
    return 0 if plans and plans[0].fit else 1


def cmd_explore_serve(ns: argparse.Namespace, plan_model) -> int:
    """`fived explore --serve`: the serving page (tp, pp, ep, weights, requests in flight)."""
    from fived.tools.explore_serve import serve_explore_data
    from fived.tools.pages import check_page, plotly_js, write_page

    plotly_js()  # (the extra is installed, before the pricing)
    check_page(ns.output)
    w = workload_from(ns)
    model, cluster = serve_cluster(ns, plan_model)
    data = serve_explore_data(
        model, cluster, w, weight_choices(ns), ns.model, training_shape(ns, w), ns.memory_headroom
    )
    out = write_page(
        ns.output, f"fived explore --serve: {model.name} on {cluster.gpus} x {cluster.hardware.name}", "serve", data
    )
    valid = sum(1 for e in data["entries"].values() if isinstance(e, dict))
    print(f"fived explore --serve: {len(data['entries'])} layouts ({valid} valid) -> {out}")
    return 0
