"""`fived calibrate`: measure the machine at hand and write a machine profile (fived.planner.profile).

One process measures the compute the planner prices, on one thread as each CPU rank runs (on a GPU,
on the device): a linear layer's three GEMMs over the shapes layouts produce, causal fused attention
forward + backward by sequence and head dim, element-wise and AdamW bandwidth, and one op's dispatch;
each timed call on operands no recent call touched, as a step's ops run (`rotation`).
Forked ranks (`fived.launch.ranks.run_ranks`: gloo on CPU, NCCL on CUDA) measure the collectives
over every group size 2..N and fived's trainer at negligible shapes on one rank (the host time per
layer and per step): `fived.tools.calibrate_ranks`. Each measurement repeats until its share of the
time budget is spent (2 repetitions at least) and keeps the mean: a training step spans many of the
scheduler's slices, so it pays the host's other processes their share of the cores, and so does a
mean over many calls; a median of short calls would measure only the calls that ran uninterrupted
(on this project's loaded machine, 4-5x too fast).
"""

from __future__ import annotations

import datetime
import functools
import itertools
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fived.config import ConfigError
from fived.planner.profile import DEFAULT_MINUTES, DEFAULT_NPROC, TIMING_QUEUED, check_output, write_profile

# what the compute measurements' operands rotate through (`rotation`), by device: on CPU about a tiny
# model's step of activations on a CPU rank (16x this project's VM's 4 MiB L2 a core; its shared L3, 480
# MiB as the VM reports it, is not this process's alone), on a GPU more than any GPU's L2 (H100/H200
# 50 MB, B200 126 MB)
ROTATION_BYTES = {"cpu": 64 * 2**20, "cuda": 512 * 2**20}
MAX_SETS = 1024  # (the smallest shapes' time is their dispatch, wherever their bytes lie)
FLOOR = 0.1  # a shape's time less the dispatch never counts below this share of what was measured


@dataclass(frozen=True)
class Sizes:
    """What is measured: the axes of every curve."""

    rows: tuple[int, ...]  # tokens of a micro-batch (or of an expert)
    width: tuple[int, ...]  # a GEMM's narrow side: hidden / tp, an expert's width
    depth: tuple[int, ...]  # its full side: the hidden
    seq: tuple[int, ...]
    head_dim: tuple[int, ...]
    stream_bytes: tuple[int, ...]  # an element-wise op's tensor
    message_bytes: tuple[int, ...]  # a collective's (the ledger's convention)


FULL = Sizes(
    rows=(16, 64, 256, 1024, 2048),
    width=(8, 32, 128, 512, 1024),  # (wider and deeper are clamped to the edge: one thread's rate has flattened)
    depth=(32, 128, 512, 1024),
    seq=(16, 64, 256, 1024, 2048),
    head_dim=(16, 64, 128),
    stream_bytes=tuple(2**k for k in range(12, 27, 2)),
    message_bytes=tuple(2**k for k in range(8, 23, 2)),
)
GPU_FULL = Sizes(  # a GPU's kernels fill the device only at real shapes: a layer's GEMMs at 1B-70B widths
    rows=(512, 2048, 8192, 32768),
    width=(256, 1024, 4096, 16384),
    depth=(1024, 2048, 4096, 8192),
    seq=(512, 1024, 2048, 4096, 8192, 16384),
    head_dim=(64, 128),
    stream_bytes=tuple(2**k for k in range(16, 31, 2)),
    message_bytes=tuple(2**k for k in range(12, 29, 2)),
)
QUICK = Sizes(  # tests and a first look: a few points per axis
    rows=(16, 256),
    width=(16, 128),
    depth=(64,),
    seq=(64, 256),
    head_dim=(16,),
    stream_bytes=(2**14, 2**20),
    message_bytes=(2**10, 2**16),
)
# share of the budget each part gets (the rest: start-up, forks, the trainer's construction)
SHARES = {
    "collectives": 0.3,
    "dimensions": 0.1,
    "host": 0.15,
    "gemm": 0.2,
    "attention": 0.1,
    "stream": 0.05,
    "contention": 0.03,
}


class Progress:
    """One line per finished part on stderr, with the time since the start and the budget."""

    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.perf_counter(), budget_s

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"fived calibrate [{elapsed:5.0f}s / {self.budget_s:.0f}s] {message}", file=sys.stderr, flush=True)


def matmul_dtype(device: torch.device) -> torch.dtype:
    """The dtype the ranks compute in: float32 on CPU (fived's CPU runs), bfloat16 on a GPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], budget_s: float, device: torch.device) -> float:
    """Mean seconds of fn() over repetitions filling `budget_s` (after one warm-up call)."""
    fn()
    sync(device)
    if device.type == "cuda":
        return queued_seconds(fn, budget_s, device)
    times: list[float] = []
    spent = 0.0
    while len(times) < 2 or spent < budget_s:  # (no cap on calls: the window, not a count, makes the mean fair)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.fmean(times)


# how kernels were timed, written into the profile (a GPU profile timed a sync per call, before 2026-11-29,
# measured launches: read_profile refuses one without this marker)
TIMING = {"cpu": "per call", "cuda": TIMING_QUEUED}


def queued_seconds(fn: Callable[[], object], budget_s: float, device: torch.device) -> float:
    """A GPU's seconds per fn(): calls queued back to back and one synchronisation per batch of them, as
    training queues its kernels (a synchronisation per call would time the launch, not the device)."""
    start = time.perf_counter()
    fn()
    sync(device)
    batch = max(1, min(1000, int(0.2 * budget_s / max(time.perf_counter() - start, 1e-6))))
    calls, spent = 0, 0.0
    while calls < 2 * batch or spent < budget_s:
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        sync(device)
        spent += time.perf_counter() - start
        calls += batch
    return spent / calls


def rotation(make: Callable[[], tuple], nbytes: int, device: torch.device) -> Callable[[], tuple]:
    """A function giving, call after call, the next of enough sets of tensors `make()` builds (`nbytes`
    each) to span `device`'s ROTATION_BYTES (2 sets at least, MAX_SETS at most): each timed call reads
    and writes memory no recent call touched, as a training step's ops do (the backward reads what the
    forward wrote long before). One set reused stays in cache and times too fast (docs/planner.md,
    "Machine profiles", has the figures)."""
    span = ROTATION_BYTES["cuda" if device.type == "cuda" else "cpu"]
    sets = [make() for _ in range(min(MAX_SETS, max(2, -(-span // max(nbytes, 1)))))]
    turn = itertools.cycle(sets)
    return lambda: next(turn)


def _ones(shapes: tuple, device: torch.device, dtype: torch.dtype) -> tuple:
    """Element-wise operands: a memory-bound op's time does not depend on the values it moves."""
    return tuple(torch.ones(shape, device=device, dtype=dtype) for shape in shapes)


def _random(shapes: tuple, device: torch.device, dtype: torch.dtype) -> tuple:
    """GEMM and attention operands: random values, as a step's are. A GPU's tensor cores ran constant
    operands 1.06-1.20x faster (likely fewer bits toggling, less power): an H200's profile on ones
    priced every layout of docs/gpu.md's 1B model too fast (2026-12-01). On CPU the values made no
    difference."""
    return tuple(torch.randn(shape, device=device, dtype=dtype) for shape in shapes)


def _copies(make: Callable[[], tuple]) -> Callable[[], tuple]:
    """`make()`'s values once, then copies of them in new memory: a rotation's sets need their own
    memory, not their own values (a copy is ~5x cheaper than drawing random numbers on CPU)."""
    first = make()
    return lambda: tuple(t.clone() for t in first)


def linear_seconds(rows: int, width: int, depth: int, slice_s: float, device: torch.device) -> float:
    """A linear layer's forward and backward GEMMs: y = x w (rows x depth @ depth x width), dx = dy w^T,
    dw = x^T dy; every input and output rotates (`rotation`: a step reads each layer's weight once per
    micro-batch too, long after the last)."""
    dtype = matmul_dtype(device)
    shapes = ((rows, depth), (depth, width), (rows, width), (rows, width), (rows, depth), (depth, width))
    tensors = rotation(
        _copies(functools.partial(_random, shapes, device, dtype)),
        sum(math.prod(s) for s in shapes) * dtype.itemsize,
        device,
    )

    def three():
        x, w, dy, y, dx, dw = tensors()
        torch.mm(x, w, out=y)
        torch.mm(dy, w.t(), out=dx)
        torch.mm(x.t(), dy, out=dw)

    return timed(three, slice_s, device)


def measure_gemm(sizes: Sizes, budget_s: float, device: torch.device) -> tuple[list, dict, float]:
    """(raw [rows, width, depth, seconds], the FLOP/s grid, the dispatch of three tiny GEMMs)."""
    shapes = [(r, w, d) for r in sizes.rows for w in sizes.width for d in sizes.depth]
    slice_s = budget_s / (len(shapes) + 1)
    # the host's dispatch of three tiny GEMMs, taken out on CPU; a GPU's queued launches overlap its work
    base = linear_seconds(1, 1, 1, slice_s, device) if device.type == "cpu" else 0.0
    raw, rates = [], {}
    for r, w, d in shapes:
        seconds = linear_seconds(r, w, d, slice_s, device)
        raw.append([r, w, d, seconds])
        rates[r, w, d] = 3 * 2 * r * w * d / max(seconds - base, FLOOR * seconds)
    grid = [[[rates[r, w, d] for d in sizes.depth] for w in sizes.width] for r in sizes.rows]
    return raw, {"rows": list(sizes.rows), "width": list(sizes.width), "depth": list(sizes.depth), "values": grid}, base


def measured_sizes(device: torch.device, quick: bool) -> Sizes:
    return QUICK if quick else GPU_FULL if device.type == "cuda" else FULL


def attention_heads(device: torch.device) -> int:
    """Heads per attention call: a CPU rank's few; on a GPU a layer's (a 1B-8B model's 16-32 heads per
    tensor-parallel rank), since a GPU's rate depends on the blocks in flight."""
    return 16 if device.type == "cuda" else 4


def attention_seconds(seq: int, head_dim: int, heads: int, slice_s: float, device: torch.device) -> float:
    """Causal fused attention's forward and backward on rotating q, k, v and output gradient; its
    outputs come from the allocator, as a step's do."""
    shape, dtype = (1, heads, seq, head_dim), matmul_dtype(device)

    copy = _copies(functools.partial(_random, (shape,) * 4, device, dtype))

    def make() -> tuple:
        q, k, v, grad = copy()
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad

    operands = rotation(make, 4 * math.prod(shape) * dtype.itemsize, device)

    def forward_backward():
        q, k, v, grad = operands()
        # (the gradients returned, not added into leaves' .grad: a step's q, k and v are no leaves)
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)

    return timed(forward_backward, slice_s, device)


def measure_attention(sizes: Sizes, budget_s: float, device: torch.device) -> tuple[list, dict]:
    """Causal attention forward + backward per head: FLOP/s of the full score matrix's count."""
    heads = attention_heads(device)
    points = [(s, d) for s in sizes.seq for d in sizes.head_dim]
    slice_s = budget_s / (len(points) + 1)
    base = attention_seconds(4, 8, 1, slice_s, device) if device.type == "cpu" else 0.0  # (as measure_gemm's)
    raw, rates = [], {}
    for s, d in points:
        seconds = attention_seconds(s, d, heads, slice_s, device)
        raw.append([s, d, heads, seconds])
        rates[s, d] = heads * 12 * d * s * s / max(seconds - base, FLOOR * seconds)
    grid = [[rates[s, d] for d in sizes.head_dim] for s in sizes.seq]
    return raw, {"seq": list(sizes.seq), "head_dim": list(sizes.head_dim), "values": grid}


def measure_stream(sizes: Sizes, budget_s: float, device: torch.device) -> tuple[list, dict, float]:
    """Element-wise c = a + b by size (bytes moved: 3 tensors; `rotation`'s), the dispatch (a rotated
    1-element add: the same path) taken out on CPU; and AdamW's step."""
    slice_s = budget_s / (len(sizes.stream_bytes) + 2)
    float32 = torch.float32

    def seconds(numel: int) -> float:
        operands = rotation(functools.partial(_ones, ((numel,),) * 3, device, float32), 3 * 4 * numel, device)
        return timed(functools.partial(_add, operands), slice_s, device)

    base = seconds(1) if device.type == "cpu" else 0.0
    raw = [[3 * nbytes, seconds(nbytes // 4)] for nbytes in sizes.stream_bytes]
    return raw, stream_curve(raw, base), optimizer_bytes_per_s(max(sizes.stream_bytes) // 4, slice_s, device)


def _add(operands: Callable[[], tuple]) -> None:
    a, b, c = operands()
    torch.add(a, b, out=c)


def stream_curve(raw: list, base: float) -> dict:
    """The element-wise curve of [bytes moved, seconds] points, `base` (one op's dispatch) taken out:
    on a GPU nothing (queued launches overlap the device's work)."""
    moved = [m for m, _ in raw]
    left = [max(s - base, FLOOR * s) for m, s in raw]
    return {"bytes": moved, "seconds": left, "latency_s": base, "bytes_per_s": moved[-1] / left[-1]}


def optimizer_bytes_per_s(params: int, slice_s: float, device: torch.device) -> float:
    """AdamW (fived.optim.adamw) over `params` float32 parameters in 4 tensors: 28 bytes each per step."""
    from fived.config import TrainConfig
    from fived.optim.adamw import build_optimizer

    weights = [torch.nn.Parameter(torch.randn(params // 4, 1, device=device)) for _ in range(4)]
    for p in weights:
        p.grad = torch.randn_like(p)
    optimizer = build_optimizer(weights, TrainConfig())
    seconds = timed(optimizer.step, slice_s, device)
    return 28 * params / seconds


def launch_seconds(budget_s: float, device: torch.device) -> float:
    """One small op's dispatch (a loop's kernel launch): an 8 x 8 matmul."""
    a = torch.randn(8, 8, device=device)
    return timed(lambda: torch.mm(a, a), budget_s, device)


def machine(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "hostname": socket.gethostname(),
        "cpu_count": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "device_type": device.type,
        "device": name,
        "memory_gib": memory / 2**30,
    }


def check_ranks(nproc: int | None, device: torch.device) -> int:
    """The ranks the collectives run on: on CPU 2 at least (default DEFAULT_NPROC); on CUDA one, which
    measures no collective (calibrate_ranks times gloo's blocking calls: NCCL's need their own timing,
    not written yet), so that a GPU's profile prices links by the catalogue's entry for it."""
    if device.type == "cuda":
        if nproc not in (None, 1):
            raise ConfigError(
                "--nproc", nproc, "on GPUs fived calibrate measures one (no collectives yet)", "--nproc 1"
            )
        return 1
    if nproc is None:
        return DEFAULT_NPROC
    if nproc < 2:
        raise ConfigError("--nproc", nproc, "collectives need 2 ranks at least", f"e.g. --nproc {DEFAULT_NPROC}")
    return nproc


def calibrate(output: str, *, nproc: int | None = None, minutes: float = DEFAULT_MINUTES, quick: bool = False) -> dict:
    """Measure this machine with `nproc` ranks within `minutes` and write the profile to `output`;
    returns the profile's contents."""
    from fived.tools.calibrate_ranks import (
        measure_collectives,
        measure_contention,
        measure_dimensions,
        measure_host,
        unpriced_dimensions,
    )

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nproc = check_ranks(nproc, device)
    if not minutes > 0:
        raise ConfigError("--minutes", minutes, "must be > 0", f"e.g. --minutes {DEFAULT_MINUTES:g}")
    check_output(output)  # refuse a file fived did not write before measuring anything
    sizes, budget_s = measured_sizes(device, quick), minutes * 60
    progress = Progress(budget_s)
    load_start, started = os.getloadavg(), datetime.datetime.now(datetime.timezone.utc)
    collectives_raw: list = []
    collectives: dict = {}
    if nproc > 1:
        collectives_raw, collectives = measure_collectives(nproc, sizes.message_bytes, budget_s * SHARES["collectives"])
        progress(f"collectives on {nproc} ranks: {len(collectives_raw)} measurements")
    else:
        progress("collectives: none measured (one GPU); plans of several GPUs price the catalogue's links")
    if device.type == "cpu":
        contention = measure_contention(nproc, budget_s * SHARES["contention"] / 2)
        progress(f"{nproc} ranks at once compute {contention['slowdown']:.2f}x slower than one alone")
    else:  # (each rank computes on its own GPU)
        contention = {"slowdown": 1.0, "note": "one GPU per rank: not measured"}
    host = measure_host(budget_s * SHARES["host"])
    progress(
        f"host: {host['layer_overhead_s'] * 1e3:.2f} ms per layer, {host['step_overhead_s'] * 1e3:.2f} ms a step, "
        f"{host['moe_layer_overhead_s'] * 1e3:.2f} ms per MoE layer + {host['expert_overhead_s'] * 1e3:.2f} per expert"
    )
    dimensions: dict = {}
    if device.type == "cpu" and nproc % 2 == 0:  # (each dimension at 2: an even number of ranks)
        dimensions = measure_dimensions(nproc, budget_s * SHARES["dimensions"])
        added = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in dimensions["added_s"].items())
        progress(f"on {nproc} ranks each dimension adds (ms; per layer, pp per micro-batch): {added}")
    elif device.type == "cpu":
        progress(f"what each dimension adds: not measured on an odd number of ranks ({nproc}; each runs at 2)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as each CPU rank runs: OMP_NUM_THREADS=1)
    try:
        gemm_raw, gemm, _ = measure_gemm(sizes, budget_s * SHARES["gemm"], device)
        progress(f"gemm: {len(gemm_raw)} shapes")
        attention_raw, attention = measure_attention(sizes, budget_s * SHARES["attention"], device)
        progress(f"attention: {len(attention_raw)} shapes")
        stream_raw, stream, optimizer = measure_stream(sizes, budget_s * SHARES["stream"], device)
        launch = launch_seconds(1.0, device)
        progress(f"stream, optimizer ({optimizer / 1e9:.1f} GB/s), dispatch ({launch * 1e6:.1f} us)")
    finally:
        torch.set_num_threads(threads)
    fitted: dict = {
        "gemm": gemm,
        "attention": attention,
        "stream": stream,
        "optimizer_bytes_per_s": optimizer,
        "launch_s": launch,
        "layer_overhead_s": host["layer_overhead_s"],
        "step_overhead_s": host["step_overhead_s"],
        "moe_layer_overhead_s": host["moe_layer_overhead_s"],
        "expert_overhead_s": host["expert_overhead_s"],
        "rank_slowdown": contention["slowdown"],
        "collectives": collectives,
    }
    doc = {
        "machine": machine(device),
        "torch": torch.__version__,
        "date": started.isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - progress.start, 1),
        "load": {"start": list(load_start), "end": list(os.getloadavg())},
        "nproc": nproc,
        "dtype": str(matmul_dtype(device)).removeprefix("torch."),
        "timing": TIMING[device.type],
        "measured": {
            "gemm": gemm_raw,
            "attention": attention_raw,
            "stream": stream_raw,
            "collectives": collectives_raw,
            "host": host["raw"],
            "contention": contention,
            "dimensions": dimensions,
        },
        "fitted": fitted,
    }
    if dimensions:  # (priced by a profile of the rest: what the planner misses per layer of each dimension)
        fitted["dimension_s"] = figures = unpriced_dimensions(doc, output, dimensions)
        progress(
            f"beyond their price the {nproc} ranks add (ms at a whole core): {figures['ranks_layer'] * 1e3:.2f} per layer, "
            f"{figures['ranks_step'] * 1e3:.2f} a step; a MoE model {figures['moe_layer'] * 1e3:.2f} per MoE layer, "
            f"{figures['moe_step'] * 1e3:.2f} a step more"
        )
    write_profile(output, doc)
    progress(f"wrote {output}")
    return doc
