"""The hardware catalogue: what one GPU can compute, hold and move, from the vendors' data sheets.

Every figure is per GPU. Link bandwidths are per direction (the data sheets quote NVLink as the sum of
both directions; a ring collective moves data one way per link). `network_gbps` is the scale-out
bandwidth each GPU has to other nodes (one NIC per GPU in DGX/HGX systems). What fraction of these a
collective achieves is a planner constant (`fived.planner.timing`), not a hardware property.

Sources (data sheets as published by the vendors):
- A100: NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB: 312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e,
  NVLink 3 600 GB/s); DGX A100 user guide (8x 200 Gb/s HDR InfiniBand, one per GPU).
- A800: NVIDIA A800 SXM4 (the A100 compute die and memory, NVLink cut to 400 GB/s).
- A100 40GB: the same data sheet (SXM4 40GB: HBM2 at 1,555 GB/s).
- H100: NVIDIA H100 Tensor Core GPU data sheet (SXM5: 989 TFLOP/s BF16 dense — 1,979 with sparsity —
  1,979 TFLOP/s FP8 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s); DGX H100 (8x 400 Gb/s NDR
  ConnectX-7). H200 and H800 have the same FP8 peak.
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

Variants a published run names ("A100-SXM4-40GB", "H100 96GB HBM2e") are their family's entry with the
memory they state (`hardware(name, memory_gib)`): the rates stay the family's.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any

from fived.config import ConfigError, did_you_mean, tomllib
from fived.planner.layout_cache import kept_hash, state_without_kept_hash


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # dense BF16 tensor-core peak, TFLOP/s
    memory_gib: float  # device memory
    hbm_gbps: float  # device memory bandwidth, GB/s
    nvlink_gbps: float  # intra-node GPU-to-GPU bandwidth per direction, GB/s
    network_gbps: float  # inter-node bandwidth per GPU per direction, GB/s
    calibration: str = "hopper"  # the generation whose fitted efficiency constants apply
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak (0: no FP8 tensor cores)
    link_latency_s: float = 10e-6  # per collective inside a node (NCCL small messages, ~10 us; assumed)
    network_latency_s: float = 25e-6  # per collective across nodes (InfiniBand, ~20-30 us; assumed)
    layer_overhead_s: float = 0.0  # per layer and micro-batch, forward + backward: op dispatch the device
    #   does not hide (0 on GPUs, whose kernels queue ahead of the host; fitted for CPU ranks)
    step_overhead_s: float = 0.0  # per step: optimizer dispatch, data, logging (fitted for CPU ranks)
    peer_latency_s: float = 0.0  # per ring step of a collective, on top of link latency (gloo's ring:
    #   (n-1) steps for all-gather, 2(n-1) for all-reduce; NCCL's trees and channels: 0, fitted for CPU)
    launch_s: float = 5e-6  # per kernel a loop launches one by one (fived's experts): CUDA launch and
    #   PyTorch dispatch (assumed), a CPU op's dispatch (fitted)
    zero3_overhead_s: float = 0.0  # host work per FSDP2 gather or reduce-scatter (copy-in/out, hooks):
    #   queued ahead on GPUs (0), fitted for CPU ranks
    core_share: float = 1.0  # share of a core (a device) each rank has: ranks sharing cores fill each
    #   other's pipeline idle time
    gemm_efficiency: float = 0.0  # share of peak every matmul reaches whatever its shape (CPU ranks:
    #   fitted by benchmarks/bench_planner_cpu.py); 0: the calibration's for `calibration`'s generation
    dispatch_s: float = 0.0  # per operator a forward without autograd (serving) dispatches from Python: host
    #   time the device does not hide (0 on GPUs, whose serving engines replay decode steps as CUDA graphs;
    #   fitted for CPU ranks by benchmarks/bench_serve_cpu.py --fit)
    profile: Any = None  # (a fived.planner.profile.MachineProfile: that module reads this one)
    # a machine profile (`fived calibrate`): its measured curves price
    #   GEMMs, attention, element-wise work and collectives instead of the rates above (fived.planner.profile)


@dataclass(frozen=True)
class Cluster:
    """The GPUs a plan is for: `gpus` of `hardware`, `gpus_per_node` in each node."""

    hardware: Hardware
    gpus: int
    gpus_per_node: int

    __hash__ = kept_hash
    __getstate__ = state_without_kept_hash


CATALOGUE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("a100", 312.0, 80.0, 2039.0, 300.0, 25.0, "ampere"),
        Hardware("a800", 312.0, 80.0, 2039.0, 200.0, 25.0, "ampere"),
        Hardware("h100", 989.0, 80.0, 3350.0, 450.0, 50.0, "hopper", 1979.0),
        Hardware("h200", 989.0, 141.0, 4800.0, 450.0, 50.0, "hopper", 1979.0),
        Hardware("h800", 989.0, 80.0, 3350.0, 200.0, 50.0, "hopper", 1979.0),
        Hardware("b200", 2250.0, 180.0, 7700.0, 900.0, 50.0, "hopper", 4500.0),
        Hardware("mi300x", 1307.0, 192.0, 5300.0, 448.0, 50.0, "hopper", 2615.0),
    )
}
HBM2_40GB_GBPS = 1555.0  # A100 SXM4 40GB (the A100 data sheet)


def hardware(name_or_path: str, memory_gib: float | None = None) -> Hardware:
    """A catalogue entry by name ('h100', 'H100-SXM5', 'A100-SXM4-40GB', 'H100 96GB HBM2e'...) or a
    TOML file of the fields; a memory size in the name (or `memory_gib`) makes the variant."""
    path = Path(name_or_path)
    if path.suffix == ".toml":
        if not path.is_file():
            raise ConfigError(
                "--gpu", name_or_path, "file not found", "give a TOML hardware file or one of " + ", ".join(CATALOGUE)
            )
        with path.open("rb") as f:
            values = tomllib.load(f)
        known = {f.name for f in fields(Hardware)} - {"profile"}  # (a profile is --machine's)
        for key in values:
            if key not in known:
                raise ConfigError(
                    f"{name_or_path}: {key}", values[key], "unknown hardware field", did_you_mean(key, known)
                )
        missing = [f.name for f in fields(Hardware) if f.name not in values and f.default is MISSING]
        if missing:
            raise ConfigError(name_or_path, ", ".join(missing), "missing hardware fields", "see fived.planner.hardware")
        hw = Hardware(**values)
        if hw.calibration not in ("ampere", "hopper"):
            raise ConfigError(f"{name_or_path}: calibration", hw.calibration, "unknown", "ampere or hopper")
        return hw
    lowered = name_or_path.lower()
    named = re.search(r"\b(" + "|".join(CATALOGUE) + r")(?!\d)", lowered)  # "NVIDIA H100 80GB HBM3", "DGX A100"
    key = named.group(1) if named else re.split(r"[-_ /]", lowered.strip())[0]
    if key not in CATALOGUE:
        raise ConfigError("--gpu", name_or_path, "unknown GPU", did_you_mean(key, CATALOGUE) + " (or a .toml file)")
    hw = CATALOGUE[key]
    stated = re.search(r"(\d+)\s*g", lowered.replace(key, "", 1))
    memory = memory_gib or (float(stated.group(1)) if stated else None)
    if not memory or memory == hw.memory_gib:
        return hw
    hbm = HBM2_40GB_GBPS if key == "a100" and memory <= 40 else hw.hbm_gbps
    return replace(hw, name=f"{key}-{memory:g}gb", memory_gib=memory, hbm_gbps=hbm)


# CPU ranks (gloo, one thread each), fitted by benchmarks/bench_planner_cpu.py on fived's measured
# step times on this project's 2-core machine (see there; on another host, refit with --fit). The
# matmul rate is that host's one-thread float32 rate (device_peak_tflops, best of five), kept fixed:
# measured again at plan time it would follow whatever else the host runs that instant.
CPU_MEDIAN_ERROR = 13.5  # % over the benchmark's layouts (what a run printed: see README)
DISPATCH_CPU_S = 2.5e-6  # benchmarks/bench_serve_cpu.py --fit (float32 priced, as the ranks run): the median of
#   three runs' fits, 2.4-3.6 us (README, "Serving")
CPU = Hardware(
    "cpu",
    0.105,
    0.0,
    10.0,
    0.5,
    0.5,
    "cpu",
    link_latency_s=1e-3,
    network_latency_s=1e-3,
    layer_overhead_s=2.25e-3,
    step_overhead_s=4e-3,
    peer_latency_s=2e-4,
    launch_s=2.5e-6,
    zero3_overhead_s=4e-3,
    gemm_efficiency=0.2,
    dispatch_s=DISPATCH_CPU_S,
)


def local_hardware(world: int, *, cuda: bool | None = None) -> Hardware:
    """The device the ranks at hand run on (`cuda`: whether a run's ranks use CUDA, its `train.device`
    resolved; None: whether the host has it): the catalogue entry of the local GPU, or for CPU ranks a
    description of this host (measured matmul rate of one thread; memory shared by the ranks; gloo
    moves tensors through shared memory and loopback sockets — a few GB/s, not fitted). A CPU run on a
    GPU host is its CPU ranks, and asks nothing of CUDA (a forked rank must not)."""
    import os

    import torch

    if torch.cuda.is_available() if cuda is None else cuda:
        name = torch.cuda.get_device_name().upper()
        for key, hw in CATALOGUE.items():
            if key.upper() in name:  # the catalogue's rates, this board's memory (A100 40GB, H100 NVL...)
                return replace(hw, memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30)
        raise ConfigError(
            "--layout",
            "auto",
            f"the GPU '{name}' is not in the planner's catalogue",
            "plan it with `fived plan --gpu my-gpu.toml` and pass the printed flags to fived train",
        )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cores = len(os.sched_getaffinity(0))
    share = min(1.0, cores / max(world, 1))  # ranks beyond the cores share them
    # host work and every collective's synchronisation wait for the ranks sharing a core
    return replace(
        CPU,
        peak_tflops=CPU.peak_tflops * share,
        memory_gib=memory / max(world, 1),
        layer_overhead_s=CPU.layer_overhead_s / share,
        step_overhead_s=CPU.step_overhead_s / share,
        link_latency_s=CPU.link_latency_s / share,
        network_latency_s=CPU.network_latency_s / share,
        zero3_overhead_s=CPU.zero3_overhead_s / share,
        peer_latency_s=CPU.peer_latency_s / share,
        dispatch_s=CPU.dispatch_s / share,
        launch_s=CPU.launch_s / share,
        core_share=share,
    )


def device_peak_tflops(dtype, configured: float = 0.0, device_type: str | None = None) -> float:
    """The configured peak, else the GPU's data-sheet peak (dense bf16, this catalogue), else one CPU
    thread's measured matmul rate in `dtype` (an estimate: MFU on CPU is only indicative).
    `device_type`: the run's ("cpu" for CPU ranks on a GPU host); None: CUDA if there is a GPU."""
    import time

    import torch

    if configured > 0:
        return configured
    if (device_type or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        name = torch.cuda.get_device_name().upper()
        return next((hw.peak_tflops for key, hw in CATALOGUE.items() if key.upper() in name), 0.0)
    n, reps = 256, 10
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = float("inf")
    # both operand layouts: a linear layer's (x @ W^T) takes another kernel than a @ b, ~8x faster in
    # bf16 on a CPU without bf16 instructions (the peak must be the model's own fastest)
    for rhs in (b, b.t()):
        a @ rhs
        for _ in range(5):  # the best of five: other processes on the host only ever slow a trial down
            start = time.perf_counter()
            for _ in range(reps):
                a @ rhs
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 * reps / best / 1e12
