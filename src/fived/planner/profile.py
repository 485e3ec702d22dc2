"""A machine profile: what `fived calibrate` measured on one machine, read back for the planner.

The file is JSON (never a pickle) with a format marker, the machine (hostname, cpu count, device),
torch's version, the date, the raw measurements and the curves fitted to them:

- gemm: a linear layer's forward + backward (its three GEMMs) in FLOP/s on a grid of
  (rows: tokens, width: the narrow output side, hidden/tp; depth: the full side, the hidden),
  with the host's per-op dispatch taken out on CPU (the host curve prices it; a GPU's kernels are
  timed queued, their launches overlapped);
- attention: causal fused attention forward + backward in FLOP/s (the full score matrix's count,
  12 * head_dim * seq^2 per head, so a causal kernel's skipped blocks are in the rate) by sequence
  length and head dim;
- stream: element-wise bandwidth (bytes read + written per second) by tensor size; optimizer: the
  AdamW step's bandwidth at 28 bytes per parameter;
- host: one op's dispatch (launch_s) and, from fived's own trainer at negligible shapes on one
  rank, the host time per layer and micro-batch and per step (the intercept), per MoE layer besides
  its experts' loop and per routed expert of the loop;
- dimension_s: what each dimension adds in fived's trainer at negligible shapes on the calibration's ranks beyond what
  the planner, priced by the rest of the profile, puts between the same runs: tp, cp and ep per layer
  and micro-batch (each at 2 against data parallelism alone, 1 and 3 layers), pp per micro-batch (2
  stages, 2 and 4 micro-batches): the host work and waits of the dimension's communication as fived
  issues it; and from the data-parallel bases of those runs (all nproc ranks, dense and MoE), what the
  ranks themselves add beyond what is priced for them, per layer and micro-batch and per step
  (`RANKS_KEYS`: the waits and host work of nproc ranks sharing cores and meeting at every collective,
  which one rank's host time and the collectives timed apart miss), priced for every layout on
  those ranks; at a whole core (optional: profiles written before 2026-11-30 lack it, before
  2026-12-01 its ranks' figures);
- rank_slowdown: how much slower a small GEMM + element-wise mix runs on each of nproc ranks running
  it at once than in one process alone (ranks sharing cores, and whatever else the host runs);
- collectives: seconds per call by op, group size and bytes (the ledger's convention: a
  reduce-scatter's input, an all-gather's output), measured with every rank of the calibration in
  a group of that size at once, as a layout's groups run.

The planner prices with them through `profile_hardware` (a `Hardware` carrying the profile):
`fived.planner.timing` asks the profile for GEMM and attention rates, element-wise bandwidth and
collective times, interpolated log-linearly between the measured points (clamped at the grid's
edges; collectives extrapolated along their fitted latency + bytes/bandwidth line). Constants that
remain fitted, not measured: FSDP2's host work per gather (`CPU.zero3_overhead_s`; a GPU's: its
catalogue entry's) and the
planner's GPU constants (link efficiency is 1 with a profile: the times are measured).
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fived.config import ConfigError
from fived.planner.hardware import CPU, Hardware, hardware

FORMAT = "fived-machine-profile"
VERSION = 1
EXPERT_KERNELS = 9  # what fived.planner.timing counts per routed expert a loop runs (3 GEMMs x forward, 2 backward)
TIMING_QUEUED = "queued"  # a GPU profile's "timing": kernels queued, one synchronisation per batch (calibrate's TIMING)
OPS = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single", "send")


def _interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear in log x between the points (clamped at both ends)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    t = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


# `fived calibrate`'s default time budget in minutes and ranks on CPU (its parser and its measuring code read these)
DEFAULT_MINUTES = 3.0
DEFAULT_NPROC = 4


@dataclass(frozen=True)
class Grid:
    """Values on a grid of axes (each ascending), interpolated log-linearly axis by axis."""

    axes: tuple[tuple[float, ...], ...]
    values: tuple  # nested tuples, axes[0] outermost

    def __call__(self, *point: float) -> float:
        return self._at(self.values, point)

    def _at(self, values, point) -> float:
        axis = self.axes[len(self.axes) - len(point)]
        if len(point) == 1:
            return _interp(axis, values, point[0])
        inner = tuple(self._at(v, point[1:]) for v in values)
        return _interp(axis, inner, point[0])


@dataclass(frozen=True)
class Curve:
    """Seconds per call of a collective by bytes: measured points, and the line fitted through them
    (latency + bytes / bandwidth) beyond the largest."""

    nbytes: tuple[float, ...]
    seconds: tuple[float, ...]
    latency_s: float
    bytes_per_s: float

    def __call__(self, nbytes: float) -> float:
        if nbytes > self.nbytes[-1]:
            return self.seconds[-1] + (nbytes - self.nbytes[-1]) / self.bytes_per_s
        return _interp(self.nbytes, self.seconds, max(nbytes, 1.0))


@dataclass(frozen=True, eq=False)  # (compared and hashed by identity: one profile, one object)
class MachineProfile:
    path: str
    machine: dict
    nproc: int  # ranks the collectives were measured with
    cores: int  # the cores the calibration had
    memory_gib: float  # the host's memory (CPU ranks share it), or one device's
    gemm: Grid  # FLOP/s by (rows, width, depth)
    attention: Grid  # FLOP/s by (seq, head_dim)
    stream: Curve  # element-wise: seconds per byte curve, read as bandwidth (see stream_bytes_per_s)
    optimizer_bytes_per_s: float
    launch_s: float
    layer_overhead_s: float
    step_overhead_s: float
    moe_layer_overhead_s: float  # a MoE layer's host time besides its routed experts' loop
    expert_overhead_s: float  # the loop's host time per routed expert (forward + backward)
    rank_slowdown: float  # a rank's compute with `nproc` ranks computing at once, over one process's alone
    collectives: dict  # {op: {group size: Curve}}; empty where one rank was measured (links: base_hardware's)
    collective_scale: float = 1.0  # the measured times at the planned ranks' core sharing (profile_hardware)
    # what fived adds for tp, cp or ep per layer and micro-batch (ep: per MoE layer), for pp per micro-batch,
    # and what the ranks themselves add (RANKS_KEYS), beyond what the op-level model prices for them, at a
    # whole core (measured: fived.tools.calibrate_ranks.unpriced_dimensions); empty in profiles written
    # before 2026-11-30 and where one rank was measured
    dimension_s: dict = field(default_factory=dict)
    dtype: str = "float32"  # what its GEMMs and attention computed in: what its ranks run (calibrate's `dtype`)

    @property
    def on_gpu(self) -> bool:
        """Measured on a GPU: its kernels launch asynchronously, so the host's dispatch runs ahead of
        the device and costs a step only where it is longer than the device's work."""
        return self.machine.get("device_type") == "cuda"

    def stream_bytes_per_s(self, tensor_bytes: float) -> float:
        return tensor_bytes / self.stream(tensor_bytes)

    def collective_s(self, op: str, group: int, nbytes: float) -> float:
        """One call on a group of `group` ranks: the nearest measured group size, scaled by the ring's
        steps ((n-1) or 2(n-1) of them: both grow as n-1) where the size was not measured."""
        by_size = self.collectives["send" if op == "recv" else op]
        near = min(by_size, key=lambda g: (abs(g - group), g))
        scale = 1.0 if op in ("send", "recv") else (group - 1) / (near - 1)
        return by_size[near](nbytes) * scale * self.collective_scale


def slowdown(profile: MachineProfile, world: int) -> float:
    """How much slower each of `world` ranks computes than one process alone: measured at the profile's
    nproc, 1 for one rank, linear in the ranks between (and beyond); 1 where one rank was measured."""
    if profile.nproc < 2:
        return 1.0
    return max(1.0, 1 + (profile.rank_slowdown - 1) * (world - 1) / (profile.nproc - 1))


def base_hardware(profile: MachineProfile, world: int) -> Hardware:
    """What a profile does not measure comes from here: the catalogue's entry for a profiled GPU (its
    links, where one GPU measured no collective; its rated peak, MFU's denominator as fived train's),
    the CPU ranks' description otherwise."""
    if not profile.on_gpu:
        return CPU
    device = str(profile.machine.get("device", ""))
    try:
        return hardware(device)
    except ConfigError:
        if world > 1 and not profile.collectives:
            raise ConfigError(
                "--machine",
                profile.path,
                f"the planner's catalogue lacks this GPU ({device}) and one GPU measured no link",
                "plan --gpus 1 with it, or several GPUs with --gpu my-gpu.toml (its links)",
            ) from None
        return replace(CPU, calibration="gpu")  # (one GPU alone: no link is priced)


def profile_hardware(profile: MachineProfile, world: int) -> Hardware:
    """The planner's hardware for `world` ranks priced by `profile`: the profile's measurements (of one
    process alone), each compute rate and host time scaled by the measured slowdown of ranks computing
    at once (`core_share` is its inverse); the collectives were measured with the profile's nproc ranks,
    scaled from its slowdown to this one."""
    share = 1 / slowdown(profile, world)
    base = base_hardware(profile, world)
    measured = max(max(row) for plane in profile.gemm.values for row in plane) * share / 1e12
    return replace(
        base,
        name=f"profile:{Path(profile.path).name}",
        peak_tflops=base.peak_tflops if base.calibration not in ("cpu", "gpu") else measured,  # (MFU's denominator)
        memory_gib=profile.memory_gib / (max(world, 1) if profile.machine.get("device_type") == "cpu" else 1),
        hbm_gbps=profile.optimizer_bytes_per_s * share / 1e9,
        layer_overhead_s=profile.layer_overhead_s / share,
        step_overhead_s=profile.step_overhead_s / share,
        launch_s=profile.expert_overhead_s / EXPERT_KERNELS / share,
        zero3_overhead_s=base.zero3_overhead_s / share,  # (fitted: not measured by calibrate)
        dispatch_s=base.dispatch_s / share,
        core_share=share,
        profile=replace(profile, collective_scale=slowdown(profile, world) / slowdown(profile, profile.nproc)),
    )


def _need(doc: dict, path: str, where: str) -> Any:
    """doc's value at 'a.b.c', or a one-line error naming the file and the field."""
    value: Any = doc
    for key in where.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ConfigError(
                f"{path}: {where}", "missing", "not a fived machine profile field", "rerun fived calibrate"
            )
        value = value[key]
    return value


def _positive(path: str, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ConfigError(f"{path}: {where}", value, "must be a positive number", "rerun fived calibrate")
    return float(value)


def _axis(path: str, where: str, value: Any) -> tuple[float, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{path}: {where}", value, "must be a non-empty list of numbers", "rerun fived calibrate")
    axis = tuple(_positive(path, f"{where}[{i}]", v) for i, v in enumerate(value))
    if list(axis) != sorted(set(axis)):
        raise ConfigError(f"{path}: {where}", value, "must be strictly ascending", "rerun fived calibrate")
    return axis


def _grid(path: str, doc: dict, where: str, names: tuple[str, ...]) -> Grid:
    axes = tuple(_axis(path, f"{where}.{n}", _need(doc, path, f"{where}.{n}")) for n in names)

    def nested(value: Any, depth: int, at: str):
        if not isinstance(value, list) or len(value) != len(axes[depth]):
            raise ConfigError(f"{path}: {at}", "...", f"must be a list of {len(axes[depth])}", "rerun fived calibrate")
        if depth == len(axes) - 1:
            return tuple(_positive(path, f"{at}[{i}]", v) for i, v in enumerate(value))
        return tuple(nested(v, depth + 1, f"{at}[{i}]") for i, v in enumerate(value))

    return Grid(axes, nested(_need(doc, path, f"{where}.values"), 0, f"{where}.values"))


def _curve(path: str, doc: dict, where: str) -> Curve:
    nbytes = _axis(path, f"{where}.bytes", _need(doc, path, f"{where}.bytes"))
    seconds = _need(doc, path, f"{where}.seconds")
    if not isinstance(seconds, list) or len(seconds) != len(nbytes):
        raise ConfigError(
            f"{path}: {where}.seconds", seconds, f"must be {len(nbytes)} numbers", "rerun fived calibrate"
        )
    return Curve(
        nbytes,
        tuple(_positive(path, f"{where}.seconds[{i}]", s) for i, s in enumerate(seconds)),
        float(_need(doc, path, f"{where}.latency_s")),
        _positive(path, f"{where}.bytes_per_s", _need(doc, path, f"{where}.bytes_per_s")),
    )


def read_profile(path: str | os.PathLike) -> MachineProfile:
    """The profile in `path`; any problem is one line naming the file and the field."""
    name = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("--machine", name, "file not found", "write one with fived calibrate --output FILE") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError("--machine", name, f"not readable as JSON ({e})", "rerun fived calibrate") from None
    return profile_of(doc, name)


def profile_of(doc: Any, name: str) -> MachineProfile:
    """The profile a document holds (`read_profile`'s checks; `name` names it in errors)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{name}: format", doc.get("format") if isinstance(doc, dict) else doc, "not " + FORMAT, "")
    if doc.get("version") != VERSION:
        raise ConfigError(f"{name}: version", doc.get("version"), f"fived reads version {VERSION}", "rerun calibrate")
    _need(doc, name, "fitted")
    collectives: dict[str, dict[int, Curve]] = {}
    nproc, machine = _positive(name, "nproc", _need(doc, name, "nproc")), _need(doc, name, "machine")
    on_gpu = isinstance(machine, dict) and machine.get("device_type") == "cuda"
    if nproc != int(nproc) or (nproc == 1 and not on_gpu):
        raise ConfigError(f"{name}: nproc", nproc, "a whole number, 2 at least on CPU (1: one GPU)", "rerun calibrate")
    if on_gpu and doc.get("timing") != TIMING_QUEUED:  # (fived calibrate timed a GPU's launches before 2026-11-29)
        raise ConfigError(f"{name}: timing", doc.get("timing"), "a GPU's kernels timed queued", "rerun fived calibrate")
    if nproc == 1 and _need(doc, name, "fitted.collectives"):
        ops = ",".join(_need(doc, name, "fitted.collectives"))
        raise ConfigError(f"{name}: fitted.collectives", ops, "none with nproc 1 (one GPU)", "{}")
    nproc = int(nproc)
    for op in OPS if nproc > 1 else ():  # (one rank measured no collective: one GPU's profile)
        by_size = _need(doc, name, f"fitted.collectives.{op}")
        if not isinstance(by_size, dict) or not by_size:
            raise ConfigError(f"{name}: fitted.collectives.{op}", by_size, "no group sizes", "rerun fived calibrate")
        collectives[op] = {}
        for size in by_size:
            if not size.isdigit() or int(size) < 2:
                raise ConfigError(f"{name}: fitted.collectives.{op}", size, "group sizes are integers >= 2", "e.g. 2")
            collectives[op][int(size)] = _curve(name, doc, f"fitted.collectives.{op}.{size}")

    def scalar(where: str) -> float:
        return _positive(name, f"fitted.{where}", _need(doc, name, f"fitted.{where}"))

    return MachineProfile(
        path=name,
        machine=_need(doc, name, "machine"),
        nproc=nproc,
        cores=int(_positive(name, "machine.cpu_count", _need(doc, name, "machine.cpu_count"))),
        memory_gib=_positive(name, "machine.memory_gib", _need(doc, name, "machine.memory_gib")),
        gemm=_grid(name, doc, "fitted.gemm", ("rows", "width", "depth")),
        attention=_grid(name, doc, "fitted.attention", ("seq", "head_dim")),
        stream=_curve(name, doc, "fitted.stream"),
        optimizer_bytes_per_s=scalar("optimizer_bytes_per_s"),
        launch_s=scalar("launch_s"),
        layer_overhead_s=scalar("layer_overhead_s"),
        step_overhead_s=scalar("step_overhead_s"),
        moe_layer_overhead_s=scalar("moe_layer_overhead_s"),
        expert_overhead_s=scalar("expert_overhead_s"),
        rank_slowdown=scalar("rank_slowdown"),
        collectives=collectives,
        dimension_s=_dimension_s(doc, name),
        dtype=_dtype(doc, name),
    )


def _dtype(doc: dict, name: str) -> str:
    """The dtype the profile measured in (`dtype`; one written before it was read: its device's,
    float32 on CPU ranks, bfloat16 on a GPU, as calibrate measures)."""
    found = doc.get("dtype")
    if found is None:
        return "bfloat16" if doc["machine"].get("device_type") == "cuda" else "float32"
    if found not in ("float32", "bfloat16"):
        raise ConfigError(
            f"{name}: dtype", found, "float32 or bfloat16 (what calibrate measures in)", "rerun calibrate"
        )
    return found


def planned_dtype(hw) -> str:
    """The dtype a plan prices and its `fived train` command runs: a machine profile's (float32 on CPU
    ranks, which measured their rates in it), else bf16 mixed precision (a GPU's catalogue entry)."""
    return hw.profile.dtype if hw.profile is not None else "bfloat16"


# `fitted.dimension_s`' figures: a dimension's (tp, cp, ep per layer and micro-batch, pp per micro-batch)
# and the calibration's ranks' own (`RANKS_KEYS`: per layer and micro-batch, per step; moe_*: a MoE
# model's beyond a dense one's, per MoE layer and micro-batch and per step)
DIMENSION_KEYS = ("tp", "cp", "ep", "pp")
RANKS_KEYS = ("ranks_layer", "ranks_step", "moe_layer", "moe_step")


def _dimension_s(doc: dict, name: str) -> dict[str, float]:
    """`fitted.dimension_s` ({DIMENSION_KEYS and RANKS_KEYS: seconds >= 0}), or {} where the profile has none."""
    found = doc["fitted"].get("dimension_s", {})
    where = f"{name}: fitted.dimension_s"
    if not isinstance(found, dict) or not set(found) <= {*DIMENSION_KEYS, *RANKS_KEYS}:
        raise ConfigError(
            where, found, "seconds of " + ", ".join((*DIMENSION_KEYS, *RANKS_KEYS)), "rerun fived calibrate"
        )
    for dim, seconds in found.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise ConfigError(f"{where}.{dim}", seconds, "a number of seconds >= 0", "rerun fived calibrate")
    return {dim: float(seconds) for dim, seconds in found.items()}


def _is_profile(path: Path) -> bool:
    data = json.loads(path.read_text())  # (fived.files: a ValueError is "not ours")
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_output(path: str | os.PathLike) -> Path:
    """`path` if fived may write a profile there: not a symlink, not a file other than a fived machine
    profile (one line says why not)."""
    from fived.files import check_output as check_path

    return check_path(path, "--output", _is_profile)


def write_profile(path: str | os.PathLike, doc: dict) -> Path:
    """Write `doc` (marked with FORMAT) to `path` atomically (check_output's rules)."""
    from fived.files import write_output

    text = json.dumps({"format": FORMAT, "version": VERSION, **doc}, indent=1) + "\n"
    return write_output(path, text, "--output", _is_profile)
