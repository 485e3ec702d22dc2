"""Helpers for multi-rank tests: run a test body on N real gloo ranks (forked processes, real
collectives, no mocks) with a short timeout, so a hung collective fails the test in seconds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fived.launch.ranks import run_ranks

TEST_TIMEOUT_S = 60.0
# Tests hold layouts to this, far tighter than `fived verify`'s 1e-9 exit threshold: a correct float64
# layout differs from the reference by summation order only (~1e-16..1e-14).
EXACT = 1e-12


def run_on_ranks(world: int, body: Callable[..., Any], *args: Any, timeout_s: float = TEST_TIMEOUT_S) -> list[Any]:
    """body(*args) on `world` ranks with the default process group initialised; returns each rank's
    return value, in rank order. A failure on any rank raises RankFailed with its traceback."""
    # Always CPU + gloo + fork (also on a GPU host): test bodies may be closures, and tests rely on
    # ranks inheriting the parent's state.
    return run_ranks(world, body, *args, timeout_s=timeout_s, deadline_s=10 * timeout_s, device="cpu")


@dataclass(frozen=True)
class ForkedRun:
    returncode: int
    stdout: str
    stderr: str


def run_forked(fn: Callable[..., int], *args: Any, timeout_s: float = 300.0) -> ForkedRun:
    """fn(*args) (an exit code, e.g. fived.cli.main.main(argv)) in a forked child of this process, with
    what it printed: a `python -m fived` subprocess without its seconds of `import torch` (the child
    has this process's modules). Its memory is given back when it exits, as a subprocess's is; past
    `timeout_s` it is killed and this raises TimeoutError."""
    import os
    import signal
    import sys
    import tempfile
    import time
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="fived-forked-") as d:
        out, err = Path(d, "stdout"), Path(d, "stderr")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _forked_child(fn, args, out, err)  # (never returns)
        deadline = time.monotonic() + timeout_s
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise TimeoutError(f"{getattr(fn, '__name__', fn)}{args}: still running after {timeout_s:g} s")
            time.sleep(0.05)
        return ForkedRun(os.waitstatus_to_exitcode(done[1]), out.read_text(), err.read_text())


def _forked_child(fn: Callable[..., int], args: tuple, out, err) -> None:
    """The child's side of run_forked: stdout and stderr (the file descriptors, and Python's objects,
    which pytest replaces) into the files, fn's exit code as the process's; it never returns into the
    parent's code, whatever fn raises."""
    import os
    import sys
    import traceback

    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        with open(1, "w", closefd=False) as stdout, open(2, "w", closefd=False) as stderr:
            sys.stdout, sys.stderr = stdout, stderr
            try:
                code = fn(*args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            stdout.flush()
            stderr.flush()
    finally:
        os._exit(code if isinstance(code, int) else 1)


def tiny_config(model: str = "tiny", **overrides: Any):
    """A small float64 config for exactness tests; overrides are {"section.field": value}."""
    from fived.config import build_config

    base = {
        "model.name": model,
        "train.steps": 3,
        "train.dtype": "float64",
        "train.global_batch": 8,
        "train.seq_len": 32,
        "train.warmup_steps": 1,
        "train.log_every": 1000,
        "train.device": "cpu",
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return build_config(overrides=base)


def write_documents(path, *, lengths=(5, 9, 17, 30, 60, 120), total: int = 60_000, seed: int = 0) -> str:
    """A text file of documents cut from the bundled corpus, each of a length drawn from `lengths`,
    each ended by the byte tokenizer's end-of-document token (NUL): data for document masking."""
    import random

    from fived.data.loader import bundled_corpus_path

    text = bundled_corpus_path().read_text()
    draw, docs, at = random.Random(seed), [], 0
    while at < total:
        n = draw.choice(lengths)
        docs.append(text[at % len(text) :][:n])
        at += n
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("\0".join(docs) + "\0")
    return str(path)
