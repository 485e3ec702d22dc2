"""The hardware catalogue: what one GPU can compute, hold and move, from the vendors' data sheets.

Every figure is per GPU. Link bandwidths are per direction (the data sheets quote NVLink as the sum of
both directions; a ring collective moves data one way per link). `network_gbps` is the scale-out
bandwidth each GPU has to other nodes (one NIC per GPU in DGX/HGX systems). What fraction of these a
collective achieves is a planner constant (`fived.planner.timing`), not a hardware property.

Sources (data sheets as published by the vendors):
- A100: NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB: 312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e,
  NVLink 3 600 GB/s); DGX A100 user guide (8x 200 Gb/s HDR InfiniBand, one per GPU).
- H100: NVIDIA H100 Tensor Core GPU data sheet (SXM5: 989 TFLOP/s BF16 dense — 1,979 with sparsity —
  80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s); DGX H100 (8x 400 Gb/s NDR ConnectX-7).
- H200: NVIDIA H200 data sheet (SXM: 989 TFLOP/s BF16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s);
  HGX H200 with 400 Gb/s NDR per GPU.
- H800: NVIDIA H800 SXM5 (the H100 compute die, NVLink cut to 400 GB/s); DeepSeek-V3 technical report
  (arXiv:2412.19437, sec. 3.1: 8 GPUs per node, 400 Gb/s InfiniBand per GPU).
- B200: NVIDIA HGX B200 data sheet (per GPU 2.25 PFLOP/s BF16 dense — 4.5 with sparsity — 180 GB HBM3e at
  7.7 TB/s, NVLink 5 1.8 TB/s); DGX B200 (8x 400 Gb/s ConnectX-7).
- MI300X: AMD Instinct MI300X data sheet (1,307 TFLOP/s BF16 dense, 192 GB HBM3 at 5.3 TB/s, 7 Infinity
  Fabric links of 64 GB/s per direction = 448 GB/s); 400 Gb/s RoCE/InfiniBand NIC per GPU.

A user's own hardware is a TOML file with the same fields:
    name = "my-gpu"
    peak_tflops = 989.0
    memory_gib = 80.0
    hbm_gbps = 3350.0
    nvlink_gbps = 450.0
    network_gbps = 50.0
    calibration = "hopper"   # which fitted efficiency constants apply (ampere | hopper)
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from fived.config import ConfigError, did_you_mean, tomllib


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense BF16 tensor-core peak, TFLOP/s
    memory_gib: float  # device memory
    hbm_gbps: float  # device memory bandwidth, GB/s
    nvlink_gbps: float  # intra-node GPU-to-GPU bandwidth per direction, GB/s
    network_gbps: float  # inter-node bandwidth per GPU per direction, GB/s
    calibration: str = "hopper"  # the generation whose fitted efficiency constants apply


CATALOGUE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("a100", 312.0, 80.0, 2039.0, 300.0, 25.0, "ampere"),
    Hardware("h100", 989.0, 80.0, 3350.0, 450.0, 50.0, "hopper"),
    Hardware("h200", 989.0, 141.0, 4800.0, 450.0, 50.0, "hopper"),
    Hardware("h800", 989.0, 80.0, 3350.0, 200.0, 50.0, "hopper"),
    Hardware("b200", 2250.0, 180.0, 7700.0, 900.0, 50.0, "hopper"),
    Hardware("mi300x", 1307.0, 192.0, 5300.0, 448.0, 50.0, "hopper"),
)}


def hardware(name_or_path: str) -> Hardware:
    """A catalogue entry by name ('h100', 'H100-SXM5', 'A100-SXM4'...) or a TOML file of the fields."""
    path = Path(name_or_path)
    if path.suffix == ".toml":
        if not path.is_file():
            raise ConfigError("--gpu", name_or_path, "file not found", "give a TOML hardware file or one of "
                              + ", ".join(CATALOGUE))
        with path.open("rb") as f:
            values = tomllib.load(f)
        known = {f.name for f in fields(Hardware)}
        for key in values:
            if key not in known:
                raise ConfigError(f"{name_or_path}: {key}", values[key], "unknown hardware field", did_you_mean(key, known))
        missing = [f.name for f in fields(Hardware) if f.name not in values and f.name != "calibration"]
        if missing:
            raise ConfigError(name_or_path, ", ".join(missing), "missing hardware fields", "see fived.planner.hardware")
        hw = Hardware(**values)
        if hw.calibration not in ("ampere", "hopper"):
            raise ConfigError(f"{name_or_path}: calibration", hw.calibration, "unknown", "ampere or hopper")
        return hw
    key = name_or_path.lower().split("-")[0]
    if key not in CATALOGUE:
        raise ConfigError("--gpu", name_or_path, "unknown GPU", did_you_mean(key, CATALOGUE) + " (or a .toml file)")
    return CATALOGUE[key]


def local_hardware(world: int) -> Hardware:
    """The device the ranks at hand run on: the catalogue entry of the local GPU, or for CPU ranks a
    description of this host (measured matmul rate of one thread; memory shared by the ranks; gloo
    moves tensors through shared memory and loopback sockets — a few GB/s, not fitted)."""
    import os

    import torch

    if torch.cuda.is_available():
        from dataclasses import replace

        name = torch.cuda.get_device_name().upper()
        for key, hw in CATALOGUE.items():
            if key.upper() in name:  # the catalogue's rates, this board's memory (A100 40GB, H100 NVL...)
                return replace(hw, memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
        raise ConfigError("--layout", "auto", f"the GPU '{name}' is not in the planner's catalogue",
                          "plan it with `fived plan --gpu my-gpu.toml` and pass the printed flags to fived train")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Hardware("cpu", device_peak_tflops(torch.float32), memory / max(world, 1), 10.0, 2.0, 2.0, "hopper")


def device_peak_tflops(dtype, configured: float = 0.0) -> float:
    """The configured peak, else the GPU's data-sheet peak (dense bf16, this catalogue), else one CPU
    thread's measured matmul rate in `dtype` (an estimate: MFU on CPU is only indicative)."""
    import time

    import torch

    if configured > 0:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().upper()
        return next((hw.peak_tflops for key, hw in CATALOGUE.items() if key.upper() in name), 0.0)
    n, reps = 256, 20
    a = torch.randn(n, n, dtype=dtype)
    a @ a
    start = time.perf_counter()
    for _ in range(reps):
        a @ a
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
