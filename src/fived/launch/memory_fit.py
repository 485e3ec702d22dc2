"""Will the model state fit? Asked before any rank starts, with the planner's memory model: each
rank's parameters, gradients and optimizer state (`fived.planner.memory.state_floor`, the largest
of any pipeline rank) against the GPU's memory, or on CPU against this machine's RAM shared by its
local ranks. A layout that cannot fit is refused in one line naming the bytes, instead of
allocating until the machine runs out of memory. (Activations come on top: this is a floor.)"""

from __future__ import annotations

import os

from fived.config import Config, ConfigError


def machine_bytes(device: str) -> int:
    """Memory one GPU has, or this machine's physical RAM."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_bytes() -> int:
    """Memory available to a new allocation on this machine (Linux's MemAvailable; else physical RAM)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(cfg: Config, world: int) -> None:
    """Refuse (ConfigError) a layout whose per-rank model state cannot fit on this machine."""
    import torch

    from fived.layout.layout import Layout
    from fived.parallel.process_group import device_type
    from fived.planner.memory import state_floor

    device = device_type(cfg.train.device)
    if device == "cuda" and not torch.cuda.is_available():
        return  # (refused by check_environment, naming the missing device)
    per_rank = state_floor(cfg.model, Layout.from_config(cfg, world), cfg.train.dtype)
    local_ranks = 1 if device == "cuda" else min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    have = machine_bytes(device)
    if per_rank * local_ranks > have:
        where = "one GPU's memory" if device == "cuda" else f"this machine's RAM (for {local_ranks} local rank(s))"
        raise ConfigError(
            "model",
            cfg.model.name,
            f"needs {per_rank / 2**30:.1f} GiB of model state per rank "
            f"({per_rank} bytes: parameters, gradients, optimizer), more than {where}: "
            f"{have / 2**30:.1f} GiB",
            "use more ranks with --zero 3 / --tp / --pp, or a smaller model",
        )
