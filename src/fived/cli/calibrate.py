"""`fived calibrate`: measure this machine and write a machine profile for `fived plan --machine`."""

from __future__ import annotations

import argparse

from fived.planner.profile import DEFAULT_MINUTES, DEFAULT_NPROC


def cmd_calibrate(ns: argparse.Namespace) -> int:
    from fived.tools.calibrate import calibrate  # (--nproc's rule depends on the device: check_ranks there)

    calibrate(ns.output, nproc=ns.nproc, minutes=ns.minutes, quick=ns.quick)
    return 0


def add_calibrate_command(sub) -> None:
    cal = sub.add_parser(
        "calibrate",
        allow_abbrev=False,
        help="measure this machine (GEMMs, attention, bandwidth, host overhead, collectives on N ranks) "
        "and write a machine profile for `fived plan --machine`",
    )
    cal.add_argument("--output", required=True, metavar="PROFILE.json", help="the profile to write")
    cal.add_argument(
        "--nproc",
        type=int,
        default=None,
        help=f"ranks the collectives run on (default {DEFAULT_NPROC} on CPU; on CUDA 1: a GPU's compute, "
        "no collectives yet)",
    )
    cal.add_argument(
        "--minutes", type=float, default=DEFAULT_MINUTES, help=f"time budget (default {DEFAULT_MINUTES:g})"
    )
    cal.add_argument("--quick", action="store_true", help="a few sizes per curve (a first look; tests)")
    cal.set_defaults(func=cmd_calibrate)
