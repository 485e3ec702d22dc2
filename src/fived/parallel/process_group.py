"""One rank's process group: joined from the environment (torchrun's, or what `fived.launch.ranks`
sets for the ranks it forks), on NCCL for CUDA and gloo for CPU, and its device."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


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
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device_type(device) == "cuda" else "gloo"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts, so a restarted rank could read the
        # addresses the previous attempt's ranks published and hang or fail connecting
        # (pytorch/pytorch#135712). Each attempt gets keys of its own.
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout)
        store = dist.PrefixStore(f"/fived/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
