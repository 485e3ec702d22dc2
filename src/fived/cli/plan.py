"""`fived plan`, `fived explore` and `fived report`: the planner's commands and the pages drawn from it.
Every figure they print or draw comes from `fived.planner`; these functions only read flags and check
them (one line per bad value, before any pricing)."""

from __future__ import annotations

import argparse
import json

from fived.api import cluster_of, plan_model
from fived.cli.serve import add_serve_flags
from fived.config import ConfigError
from fived.errors import NOT_GIVEN
from fived.planner.profile import planned_dtype

DEFAULT_HEADROOM_GIB = 3.0  # so that a winner is not packed to the last GiB of the planner's estimate
RUNTIME_CHOICES = ("fived", "fived-fp8", "fived-eager", "megatron-core", "megatron-core-fp8", "fsdp", "fsdp-fp8")


def cmd_plan(ns: argparse.Namespace) -> int:

    from fived.planner import calibration, explain
    from fived.planner.runtimes import planned_runtime
    from fived.planner.search import plan

    if ns.serve:
        from fived.cli.serve import cmd_plan_serve

        return cmd_plan_serve(ns, plan_model)
    if ns.validate:
        return 0 if calibration.validate(ns.validate)["predicted"] else 1  # (no row priced: nothing validated)
    if ns.layout:
        return cmd_plan_layout(ns)
    if ns.memory_headroom < 0:
        raise ConfigError("--memory-headroom", ns.memory_headroom, "must be >= 0 (GiB left free on each GPU)", "e.g. 3")
    if ns.top < 1:
        raise ConfigError("--top", ns.top, "must be >= 1", "e.g. 5")
    model, cluster, global_batch = plan_cluster(ns, "plan")
    runtime = planned_runtime(ns.runtime, cluster.hardware)
    if ns.memory_headroom >= cluster.hardware.memory_gib:
        raise ConfigError(
            "--memory-headroom",
            ns.memory_headroom,
            f"leaves nothing of {cluster.hardware.memory_gib:g} GiB per GPU",
            "a few GiB, e.g. 3",
        )
    # bf16 mixed precision, priced at the bf16 peak (FP8 GEMMs at the FP8 peak with a -fp8 runtime); a
    # machine profile's own dtype (CPU ranks: float32)
    dtype = planned_dtype(cluster.hardware)
    search = plan(model, cluster, ns.seq, global_batch, dtype, runtime, ns.memory_headroom, keep=ns.top)
    if ns.json:
        found = explain.to_json(search, model, cluster, ns.seq, global_batch, ns.top, runtime, ns.memory_headroom)
        print(json.dumps({**found, "dtype": dtype}, indent=1))
    else:
        model_arg = f"--config {ns.model}" if ns.model.endswith(".toml") else f"--model {ns.model}"
        print(
            explain.report(
                search,
                model,
                cluster,
                ns.seq,
                global_batch,
                ns.top,
                model_arg,
                dtype,
                runtime=runtime,
                headroom_gib=ns.memory_headroom,
            )
        )
    return 0 if search.plans else 1


def plan_cluster(ns: argparse.Namespace, command: str):
    """The model, cluster and global batch (sequences) `fived plan`/`fived explore` were given."""
    missing = [
        flag
        for flag, v in (
            ("--model", ns.model),
            ("--gpus", ns.gpus),
            ("--seq", ns.seq),
            ("--global-batch-tokens", ns.global_batch_tokens),
        )
        if v is None
    ]
    if missing:
        raise ConfigError(
            missing[0],
            NOT_GIVEN,
            "required",
            f"fived {command} --model llama3-8b --gpus 64 --gpus-per-node 8 "
            "--gpu h100 --seq 8192 --global-batch-tokens 4194304"
            + (" (or --validate FILE.csv)" if command == "plan" else ""),
        )
    return cluster_of(
        ns.model,
        ns.gpus,
        ns.gpus_per_node,
        ns.gpu,
        ns.seq,
        ns.global_batch_tokens,
        machine=getattr(ns, "machine", None),
    )


def cmd_plan_layout(ns: argparse.Namespace) -> int:
    """`fived plan --layout FLAGS`: the planner's figures for that one layout (fitting or not)."""

    from fived.planner.runtimes import planned_runtime
    from fived.planner.search import plan_of  # (layout_from_flags refused a layout that cannot run)
    from fived.tools.explore import layout_from_flags

    model, cluster, global_batch = plan_cluster(ns, "plan")
    runtime = planned_runtime(ns.runtime, cluster.hardware)
    layout = layout_from_flags(model, ns.layout, cluster.gpus, ns.seq, global_batch)
    plan = plan_of(
        model,
        layout,
        cluster,
        ns.seq,
        global_batch,
        planned_dtype(cluster.hardware),
        runtime,
        headroom_gib=ns.memory_headroom,
    )
    out = {**plan.to_dict(global_batch, runtime), "fits": plan.fits}
    if ns.json:
        dtype = planned_dtype(cluster.hardware)
        print(json.dumps({"model": model.name, "gpus": cluster.gpus, "dtype": dtype, "plans": [out]}, indent=1))
    else:
        print(
            f"{layout.describe()}: {out['memory_gib']['total']:.2f} GiB per GPU "
            f"({'fits' if plan.fits else 'does not fit'} in {out['capacity_gib']:.4g}), step {plan.time.total:.3g} s, "
            f"{plan.time.tokens_per_s_per_gpu:.1f} tokens/s/GPU, MFU {plan.time.mfu:.1%}"
        )
    return 0


def cmd_explore(ns: argparse.Namespace) -> int:
    from fived.tools.explore import explore_data

    if ns.serve:
        from fived.cli.serve import cmd_explore_serve

        return cmd_explore_serve(ns, plan_model)
    from fived.tools.pages import check_page, plotly_js, write_page

    plotly_js()  # (the extra is installed, before the minute of pricing)
    check_page(ns.output)
    model, cluster, global_batch = plan_cluster(ns, "explore")
    dtype = planned_dtype(cluster.hardware)
    data = explore_data(model, cluster, ns.seq, global_batch, dtype, ns.memory_headroom, progress=explore_progress())
    out = write_page(
        ns.output, f"fived explore: {model.name} on {cluster.gpus} x {cluster.hardware.name}", "explore", data
    )
    reachable = [e for e in data["entries"] if e is not None]
    valid = sum(1 for e in reachable if isinstance(e, list))  # (a reason is its index: an int)
    best = f"; opens on the planner's best: {data['ranking'][0]['describe']}" if data["ranking"] else "; nothing fits"
    print(f"fived explore: {len(reachable)} layouts ({valid} valid){best} -> {out}")
    return 0


def explore_progress():
    """The pricing's progress on stderr (stdout keeps the one result line): a line redrawn in place on a
    terminal, else one line per tenth."""
    import sys
    import time

    start, tty, shown = time.perf_counter(), sys.stderr.isatty(), [-1]

    def show(done: float) -> None:
        tenth = int(done * 10)
        if not tty and tenth == shown[0]:
            return
        shown[0] = tenth
        bar = "#" * int(done * 30)
        line = f"fived explore: pricing [{bar:<30}] {done:4.0%} {time.perf_counter() - start:5.0f} s"
        print("\r" + line if tty else line, end="\n" if not tty or done >= 1 else "", file=sys.stderr, flush=True)

    return show


def cmd_report(ns: argparse.Namespace) -> int:
    from fived.tools.pages import check_page, plotly_js, write_page
    from fived.tools.run_report import report_data

    plotly_js()
    output = ns.output or f"{ns.run_dir}/report.html"
    check_page(output)
    data = report_data(ns.run_dir)
    out = write_page(output, f"fived report: {ns.run_dir}", "report", data)
    print(f"fived report: {data['summary']} -> {out}")
    return 0


def cmd_diagnose(ns: argparse.Namespace) -> int:
    from fived.tools.diagnose import diagnose, format_diagnosis

    found = diagnose(ns.run_dir)
    print(json.dumps(found, indent=1) if ns.json else format_diagnosis(found))
    return 0


def add_cluster_flags(parser) -> None:
    """The model and cluster flags `plan` and `explore` share."""
    parser.add_argument(
        "--model", help="a preset (llama3-405b, mixtral-8x7b, ...) or a TOML config with a [model] table"
    )
    parser.add_argument("--gpus", type=int, help="GPUs in the job")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink (default 8)")
    parser.add_argument("--gpu", default="h100", help="a100, h100, h200, h800, b200, mi300x or a hardware .toml")
    parser.add_argument(
        "--machine",
        metavar="PROFILE.json",
        help="price the ranks with this machine's measured profile (`fived calibrate`) instead of --gpu",
    )
    parser.add_argument("--seq", type=int, help="sequence length")
    parser.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    parser.add_argument(
        "--memory-headroom",
        type=float,
        default=DEFAULT_HEADROOM_GIB,
        metavar="GIB",
        help=f"GiB each GPU keeps free beyond the planner's peak (default {DEFAULT_HEADROOM_GIB:g})",
    )


def add_plan_commands(sub) -> None:
    """The `plan`, `explore` and `report` subcommands."""
    planp = sub.add_parser(
        "plan", allow_abbrev=False, help="rank 5D layouts for a model on a cluster by predicted memory and step time"
    )
    add_cluster_flags(planp)
    planp.add_argument("--top", type=int, default=5, help="plans to list (default 5)")
    planp.add_argument("--json", action="store_true", help="machine-readable output")
    planp.add_argument(
        "--validate",
        metavar="FILE.csv",
        help="predict published runs and print the error per row, in sample, on held-out rows (split test) "
        "and leave-one-source-out",
    )
    planp.add_argument(
        "--runtime",
        default="fived",
        choices=RUNTIME_CHOICES,
        help="plan for fived (default: what `fived train` runs) or, to compare, another runtime "
        "(its layouts may not be runnable by fived)",
    )
    planp.add_argument(
        "--layout",
        metavar="FLAGS",
        help="price this one layout (fived train's layout flags, as "
        "'--parallel.tp 4 --parallel.zero 3'), fitting or not, instead of searching",
    )
    add_serve_flags(planp)
    planp.set_defaults(func=cmd_plan, quick_exit=True)  # (it writes nothing: `main.console`)
    explore = sub.add_parser(
        "explore",
        allow_abbrev=False,
        help="write an offline HTML page to toggle a model's 5D "
        "layout and see the planner's memory, communication, pipeline and step time",
    )
    add_cluster_flags(explore)
    explore.add_argument("--output", default="explore.html", help="the page to write (default explore.html)")
    add_serve_flags(explore)
    explore.set_defaults(func=cmd_explore)
    report = sub.add_parser(
        "report",
        allow_abbrev=False,
        help="write an offline HTML page of a training run: "
        "metrics over steps, measured vs planned bytes, pipeline timeline, expert load",
    )
    report.add_argument("run_dir", help="a `fived train` output directory")
    report.add_argument("--output", help="the page to write (default RUN_DIR/report.html)")
    report.set_defaults(func=cmd_report)
    diagnose = sub.add_parser(
        "diagnose",
        allow_abbrev=False,
        help="why a training run is slow: its measured step "
        "breakdown vs the planner's, the failure modes present, and the layouts to try next",
    )
    diagnose.add_argument("run_dir", help="a finished `fived train` output directory")
    diagnose.add_argument("--json", action="store_true", help="machine-readable output")
    diagnose.set_defaults(func=cmd_diagnose)
