"""Start N local ranks and collect what each returns; or join the ranks torchrun already started.

On CPU the ranks are forked from this process (torch is already imported, so a rank starts in
~0.2 s instead of seconds) and rendezvous on a local TCP store with gloo. On CUDA they are spawned
(CUDA does not survive fork) and use NCCL. The same `run_ranks` drives `fived train --nproc N`,
`fived verify` and the multi-rank tests.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist


class RankFailed(RuntimeError):
    pass


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def device_type(requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(timeout_s: float = 600.0, device: str = "auto") -> None:
    """Initialise the default process group from the environment (torchrun or run_ranks)."""
    if dist.is_initialized():
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if device_type(device) == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device_type(device) == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str, timeout_s: float, device: str,
               fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    code = 0
    try:
        init_distributed(timeout_s, device)
        result = ("ok", fn(*args), time.time())
    except BaseException as e:  # report every failure to the parent, whatever it is
        result, code = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}", time.time()), 1
    try:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except Exception:
        code = 2
    # Ending with destroy + os._exit avoids the random aborts at interpreter exit seen with gloo.
    try:
        shutdown_distributed()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(world: int, fn: Callable, *args: Any, timeout_s: float = 600.0,
              deadline_s: float | None = None, device: str = "auto") -> list[Any]:
    """Run fn(*args) on `world` fresh ranks with an initialised process group; return their results.

    `timeout_s` bounds each collective; `deadline_s` (if given) the whole run. If any rank fails,
    the others are killed (they would otherwise wait on a collective until the timeout) and
    RankFailed carries the failing rank's traceback."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cuda = device_type(device) == "cuda"
    if cuda and world > torch.cuda.device_count():
        raise RankFailed(f"{world} ranks need {world} GPUs; this machine has {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn" if cuda else "fork")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="fived-ranks-") as out_dir:
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, out_dir, timeout_s, device, fn, args), daemon=False)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + deadline_s if deadline_s else float("inf")
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join()
        results, errors = [], []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, value, when = pickle.load(f)
                if status == "ok":
                    results.append(value)
                else:
                    errors.append((when, value))
            elif p.exitcode not in (0, -signal.SIGKILL):
                errors.append((float("inf"), f"rank {r}: exited with code {p.exitcode} and no report"))
        if errors or len(results) != world:
            # The first failure is the cause; later ones are usually peers losing their connection.
            raise RankFailed(min(errors)[1] if errors else "ranks killed after the timeout or another rank's failure")
        return results
