"""Start N local ranks and collect what each returns; or join the ranks torchrun already started.

On CPU the ranks are forked from this process (torch is already imported, so a rank starts in
~0.2 s instead of seconds) and rendezvous on a local TCP store with gloo. On CUDA they are spawned
(CUDA does not survive fork) and use NCCL. The same `run_ranks` drives `fived train --nproc N`,
`fived verify` and the multi-rank tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fived.compat import gloo_groups_on_one_device
from fived.errors import Stopped
from fived.parallel.process_group import device_type, init_distributed, shutdown_distributed
from fived.write_errors import refused_write_summary


class RankFailed(RuntimeError):
    """A rank failed: `rank`, `reason` (one line), and each reporting rank's summary (e.g. a
    collective timeout's op, group and ranks) in `summaries`."""

    def __init__(self, message: str, rank: int | None = None, reason: str = "", summaries: list | None = None):
        super().__init__(message)
        self.rank, self.reason, self.summaries = rank, reason or message.splitlines()[0], summaries or []

    def line_of(self, kind: str) -> str | None:
        """The launcher's line for the first rank that reported a failure of `kind` (e.g. "diverged",
        "write_failed": summaries with a "line"), or None if none did."""
        found = [s for s in self.summaries if s.get("kind") == kind]
        return "fived train: " + found[0]["line"] if found else None


class PortTaken(RuntimeError):
    """The rendezvous port was taken by another process before rank 0 bound it (`_reserved_port` holds
    it, but a process binding that port by number with SO_REUSEADDR still can): nothing ran yet, so
    the launcher tries again on another port."""

    def summary(self) -> dict:
        return {"kind": "port_taken", "line": str(self).splitlines()[0]}


PORT_ATTEMPTS = 3


@contextlib.contextmanager
def _reserved_port() -> Iterator[int]:
    """A port for rank 0's store, held bound (SO_REUSEADDR, not listening) until the ranks are done.
    A port merely found free could go to another launcher in the moment before rank 0 binds it, whose
    ranks would then join this run's store (gloo's "connectFullMesh failed" with two test workers);
    held, no other bind(0) or outgoing connection gets it, while rank 0's store (SO_REUSEADDR too)
    can still bind and listen on it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: this rank gets SIGKILL when the launcher dies, however it dies (no orphans)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _rank_main(
    rank: int, world: int, port: int, out_dir: str, timeout_s: float, device: str, fn: Callable, args: tuple
) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process: the launcher handles it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (not the launcher's handler, inherited by fork)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    code = 0
    try:
        if device_type(device) == "cpu":  # (every rank on this machine, at MASTER_ADDR)
            gloo_groups_on_one_device("127.0.0.1")
        try:
            init_distributed(timeout_s, device)
        except RuntimeError as e:  # (torch's DistNetworkError)
            if "EADDRINUSE" in str(e):
                raise PortTaken(f"port {port} taken by another process before rank {rank} bound it") from e
            raise
        result: tuple[str, Any, float, dict | None] = ("ok", fn(*args), time.time(), None)
    except BaseException as e:  # report every failure to the parent, whatever it is
        summary = e.summary() if hasattr(e, "summary") else refused_write_summary(e)
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}", time.time(), summary)
        code = 1
    try:  # (whole or absent: a rank killed while writing, e.g. a second SIGTERM, leaves no half of it)
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        with open(f"{path}.part", "wb") as f:
            pickle.dump(result, f)
        os.replace(f"{path}.part", path)
    except Exception:
        code = 2
    # Ending with destroy + os._exit avoids the random aborts at interpreter exit seen with gloo.
    try:
        shutdown_distributed()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


FAILURE_REPORT_S = 3.0  # after a rank fails, how long the others may take to report (their own timeouts)


class _Ranks:
    """The rank processes of one run_ranks call, and how the launcher stops them."""

    def __init__(self, procs: list, grace_s: float):
        self.procs, self.grace_s = procs, grace_s
        self.stop_signal: str | None = None  # set by a signal handler
        self.stop_by = float("inf")  # when ranks still running are killed
        self.abandoned_save = False  # a second signal came while the ranks saved for the first

    def on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        first = self.stop_signal is None
        self.stop_signal = name
        if signum == signal.SIGTERM and first and self.grace_s > 0:
            self.signal_all(signal.SIGTERM)  # ranks save at the next step boundary, then exit
            self.stop_by = time.monotonic() + self.grace_s
        else:  # Ctrl-C, a second signal, or nothing to save: stop now
            self.abandoned_save = self.abandoned_save or (not first and self.grace_s > 0)
            self.stop_by = 0.0

    def signal_all(self, signum: int) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    def wait(self, deadline: float) -> None:
        self.died: dict[int, float] = {}  # rank -> when it was seen dead (before the launcher killed any)
        failed_at = None
        while any(p.is_alive() for p in self.procs):
            now = time.monotonic()
            if self._note_dead():
                failed_at = failed_at or now
            if (failed_at is not None and now - failed_at > FAILURE_REPORT_S) or now > min(deadline, self.stop_by):
                break
            time.sleep(0.02)
        self._note_dead()  # (the last ranks may have ended between two looks: before anyone killed them)

    def _note_dead(self) -> bool:
        """Note the ranks that ended with an error since the last look; whether there were any."""
        new = [r for r, p in enumerate(self.procs) if p.exitcode not in (None, 0) and r not in self.died]
        for r in new:
            self.died[r] = time.time()
        return bool(new)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()


def run_ranks(
    world: int,
    fn: Callable,
    *args: Any,
    timeout_s: float = 600.0,
    deadline_s: float | None = None,
    device: str = "auto",
    grace_s: float = 0.0,
) -> list[Any]:
    """Run fn(*args) on `world` fresh ranks with an initialised process group; return their results.

    `timeout_s` bounds each collective; `deadline_s` (if given) the whole run. If any rank fails,
    the others are killed (they would otherwise wait on a collective until the timeout) and
    RankFailed names the failing rank with its traceback. SIGINT kills every rank at once; SIGTERM
    is passed to the ranks, which get `grace_s` to stop by themselves (a preemption save) before they
    are killed (at once if grace_s is 0); either raises Stopped. No rank outlives the launcher."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cuda = device_type(device) == "cuda"
    if cuda and world > torch.cuda.device_count():
        raise RankFailed(f"{world} ranks need {world} GPUs; this machine has {torch.cuda.device_count()}")
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _launch(world, fn, args, timeout_s, deadline_s, device, grace_s)
        except RankFailed as failed:
            if failed.line_of("port_taken") is None:
                raise
    return _launch(world, fn, args, timeout_s, deadline_s, device, grace_s)


def _launch(
    world: int, fn: Callable, args: tuple, timeout_s: float, deadline_s: float | None, device: str, grace_s: float
) -> list[Any]:
    ctx = mp.get_context("spawn") if device_type(device) == "cuda" else mp.get_context("fork")
    with _reserved_port() as port, tempfile.TemporaryDirectory(prefix="fived-ranks-") as out_dir:
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, out_dir, timeout_s, device, fn, args), daemon=False)
            for r in range(world)
        ]
        ranks = _Ranks(procs, grace_s)
        previous = _install_handlers(ranks.on_signal)
        try:
            with _frozen_heap(ctx.get_start_method() == "fork"):
                for p in procs:
                    p.start()
            if ranks.stop_signal == "SIGTERM" and ranks.stop_by > 0:  # (it came while ranks were starting)
                ranks.signal_all(signal.SIGTERM)
            ranks.wait(time.monotonic() + deadline_s if deadline_s else float("inf"))
        finally:
            ranks.kill_all()
            _restore_handlers(previous)
        return _collect(procs, out_dir, ranks.stop_signal, getattr(ranks, "died", {}), ranks.abandoned_save)


@contextlib.contextmanager
def _frozen_heap(forking: bool):
    """This process's objects out of the garbage collector's sight while ranks are forked from it:
    a rank's collections then walk only the objects it made. Otherwise every full collection in
    every rank reads and writes the header of each object it inherited (a pytest session holds
    hundreds of thousands), and each page so touched is copied for that rank (copy-on-write): CPU
    time, most of it the kernel's. The parent collects them again as before once the ranks exist."""
    frozen_before = gc.get_freeze_count()
    if forking:
        gc.freeze()
    try:
        yield
    finally:
        if forking and frozen_before == 0:  # (a caller's own freeze stays)
            gc.unfreeze()


def _install_handlers(handler) -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore_handlers(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


def _collect(
    procs: list, out_dir: str, stop_signal: str | None, died: dict[int, float], abandoned_save: bool = False
) -> list[Any]:
    results, errors = [], []  # errors: (killed by a signal first, when, rank, message, summary)
    for r, p in enumerate(procs):
        path = os.path.join(out_dir, f"rank{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                status, value, when, summary = pickle.load(f)
            if status == "ok":
                results.append(value)
            else:
                errors.append((1, when, r, value, summary))
        elif r in died:  # dead before the launcher killed anyone: a signal from outside, or a crash
            how = (
                f"was killed by {signal.Signals(-p.exitcode).name}"
                if p.exitcode < 0
                else f"exited with code {p.exitcode}"
            )
            errors.append((0 if p.exitcode < 0 else 1, died[r], r, f"rank {r} {how}, without a report", None))
    if stop_signal is not None:
        raise Stopped(stop_signal, results if len(results) == len(procs) else None, abandoned_save)
    if errors or len(results) != len(procs):
        if not errors:
            raise RankFailed("ranks killed after the timeout or another rank's failure")
        # The cause: a rank killed by a signal (out-of-memory, SIGKILL), else the first failure;
        # later failures are usually peers losing their connection.
        _, _, rank, message, _ = min(errors, key=lambda e: (e[0], e[1], e[2]))
        summaries = [e[4] for e in sorted(errors, key=lambda e: e[1]) if e[4] is not None]
        raise RankFailed(message, rank, message.splitlines()[0], summaries)
    return results
