"""`fived tune`: measure the planner's top layouts on these ranks, refit, name the fastest measured."""

from __future__ import annotations

import argparse
import sys

from fived.config import ConfigError

DEFAULT_MINUTES = 5.0
DEFAULT_TOP = 6
DEFAULT_NPROC = 4


def cmd_tune(ns: argparse.Namespace) -> int:
    from fived.launch.run_setup import build_from_args, overrides_of
    from fived.tools.tune import tune

    given = sorted(k for k in overrides_of(ns) if k.startswith("parallel."))
    if given:
        raise ConfigError(
            f"--{given[0]}", getattr(ns, given[0]), "fived tune chooses the layout", "drop the layout flags"
        )
    if ns.minutes <= 0:
        raise ConfigError("--minutes", ns.minutes, "must be > 0", f"e.g. --minutes {DEFAULT_MINUTES:g}")
    if ns.top < 1:
        raise ConfigError("--top", ns.top, "must be >= 1", f"e.g. --top {DEFAULT_TOP}")
    world = DEFAULT_NPROC if ns.nproc is None else ns.nproc
    if world < 1:
        raise ConfigError("--nproc", world, "must be >= 1", f"e.g. --nproc {DEFAULT_NPROC}")
    cfg = build_from_args(ns)
    hardware = None
    if ns.machine:
        from fived.planner.profile import profile_hardware, read_profile

        hardware = profile_hardware(read_profile(ns.machine), world)
        warn_dtype(ns.machine, hardware.profile.dtype, cfg.train.dtype)
    summary = tune(cfg, world, minutes=ns.minutes, top=ns.top, hardware=hardware)
    print(report(summary, cfg, world, model_arg(ns, cfg)))
    return 0 if summary["winner"] is not None else 1


def warn_dtype(machine: str, measured: str, dtype: str) -> None:
    """One line where the profile measured matmuls in another dtype than the run computes in: the
    planner's first ranking prices them at the profile's rates (CPU ranks: bf16 matmuls run several
    times slower than float32's); the refit then corrects the components from the trials."""
    from fived.layout.layout import PRECISION_SPECS

    compute = PRECISION_SPECS[dtype].compute
    if compute != measured:
        print(
            f"fived: warning: --machine {machine} measured {measured} matmuls and train.dtype={dtype} computes in "
            f"{compute}: the first ranking prices them at {measured}'s rates until the refit; e.g. --train.dtype "
            f"{measured}",
            file=sys.stderr,
        )


def model_arg(ns: argparse.Namespace, cfg) -> str:
    return f"--config {ns.config}" if ns.config else f"--model {cfg.model.name}"


def report(summary: dict, cfg, world: int, model: str) -> str:
    """The predicted-vs-measured table, the refit, and the measured winner with its command."""
    from fived.tools.tune import refitted_s

    factors = summary["factors"]
    lines = [
        f"\n{'#':>3}  {'layout':<40} {'predicted ms':>12} {'measured ms':>12} {'error':>7} {'refit ms':>9} {'error':>7}"
    ]
    for i, t in enumerate(summary["trials"]):
        after = refitted_s(t.predicted, factors)
        if t.measured_s is None:
            lines.append(f"{i + 1:>3}  {t.layout.describe():<40} {t.predicted_s * 1e3:>12.1f}  {t.failure}")
            continue
        lines.append(
            f"{i + 1:>3}  {t.layout.describe():<40} {t.predicted_s * 1e3:>12.1f} {t.measured_s * 1e3:>12.1f} "
            f"{(t.predicted_s / t.measured_s - 1) * 100:>+6.1f}% {after * 1e3:>9.1f} {(after / t.measured_s - 1) * 100:>+6.1f}%"
        )
    lines.append(
        "refit, measured / predicted per component over the trials: "
        + ", ".join(f"{k} {v:.2f}" for k, v in factors.items() if any(t.predicted[k] for t in summary["trials"]))
    )
    lines.append(
        f"median |error| on the trials: {summary['error_before']:.1f}% as planned, {summary['error_after']:.1f}% "
        f"after the refit (the worst trial {summary['worst_after']:.1f}%; fitted on these trials: in sample)"
    )
    winner = summary["winner"]
    if winner is None:
        lines.append("no trial finished: nothing measured (each trial's reason above)")
        return "\n".join(lines)
    pick = summary["refit_pick"]
    if pick is not None and pick != winner.layout:
        measured = {t.layout for t in summary["trials"] if t.measured_s is not None}
        note = "measured above" if pick in measured else "not measured: run fived tune with a larger --top"
        lines.append(f"after the refit the planner would rank first {pick.describe()} ({note})")
    lines += [
        f"fastest measured: {winner.layout.describe()}, {winner.measured_s * 1e3:.1f} ms/step "
        f"(tune took {summary['seconds']:.0f} s)",
        f"  run it: fived train {model} --nproc {world} --train.seq_len {cfg.train.seq_len} "
        f"--train.dtype {cfg.train.dtype} {winner.layout.flags(cfg.train.global_batch)}",
    ]
    return "\n".join(lines)


def add_tune_command(sub) -> None:
    from fived.launch.run_setup import add_config_flags

    tune = sub.add_parser(
        "tune",
        allow_abbrev=False,
        help="run the planner's top layouts for a few steps each on these ranks, refit the planner on "
        "what they measured, and print the fastest measured layout with its fived train command",
    )
    add_config_flags(tune, nproc_help=f"local ranks the trials run on (default {DEFAULT_NPROC})")
    tune.add_argument(
        "--minutes", type=float, default=DEFAULT_MINUTES, help=f"time budget (default {DEFAULT_MINUTES:g})"
    )
    tune.add_argument("--top", type=int, default=DEFAULT_TOP, help=f"layouts to measure (default {DEFAULT_TOP})")
    tune.add_argument("--machine", metavar="PROFILE.json", help="price with this machine profile (fived calibrate)")
    tune.set_defaults(func=cmd_tune)
