"""Helpers for multi-rank tests: run a test body on N real gloo ranks (forked processes, real
collectives, no mocks) with a short timeout, so a hung collective fails the test in seconds."""
from __future__ import annotations

from typing import Any, Callable

from fived.launch import run_ranks

TEST_TIMEOUT_S = 60.0


def run_on_ranks(world: int, body: Callable[..., Any], *args: Any, timeout_s: float = TEST_TIMEOUT_S) -> list[Any]:
    """body(*args) on `world` ranks with the default process group initialised; returns each rank's
    return value, in rank order. A failure on any rank raises RankFailed with its traceback."""
    return run_ranks(world, body, *args, timeout_s=timeout_s)


def tiny_config(model: str = "tiny", **overrides: Any):
    """A small float64 config for exactness tests; overrides are {"section.field": value}."""
    from fived.config import build_config

    base = {"model.name": model, "train.steps": 3, "train.dtype": "float64", "train.global_batch": 8,
            "train.seq_len": 32, "train.warmup_steps": 1, "train.log_every": 1000}
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return build_config(overrides=base)
