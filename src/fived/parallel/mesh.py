"""The device mesh of a layout: `Mesh` builds a `fived.layout.Layout`'s process groups, and the
torch dtypes of each `train.dtype` (`PRECISIONS`, from the layout core's `PRECISION_SPECS`). The
layout itself and the rules it must meet are plain Python in `fived.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fived.compat import flatten_mesh, forget_dtensor_meshes, process_group_options
from fived.config import Config
from fived.layout.layout import (
    CHECKPOINTING,
    COMPILE_BACKENDS,
    GROUP_DIMS,
    GROUP_NAMES,
    MESH_DIMS,
    MESHES,
    PP_SCHEDULES,
    PRECISION_SPECS,
    SINGLE_STAGE,
    SPLIT_BACKWARD,
    V_SHAPED,
    Layout,
    parameter_dtype,
    resolve_dp,
    stages_per_rank,
)

__all__ = [
    "CHECKPOINTING",
    "COMPILE_BACKENDS",
    "DTYPES",
    "GROUP_NAMES",
    "MESH_DIMS",
    "PP_SCHEDULES",
    "PRECISIONS",
    "SINGLE_STAGE",
    "SPLIT_BACKWARD",
    "V_SHAPED",
    "Layout",
    "Mesh",
    "Precision",
    "build_dtype",
    "resolve_dp",
    "stages_per_rank",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class Precision:
    """A `train.dtype` in torch dtypes (see `fived.layout.layout.PrecisionSpec`)."""

    weights: torch.dtype
    compute: torch.dtype
    master: bool = False

    @property
    def autocast(self) -> bool:
        return self.compute != self.weights


PRECISIONS = {name: Precision(DTYPES[s.weights], DTYPES[s.compute], s.master) for name, s in PRECISION_SPECS.items()}


def build_dtype(cfg: Config) -> torch.dtype:
    """The dtype the model's parameters are built in: the precision's weights, except that ZeRO-3
    (FSDP2) holds bf16 runs' float32 masters as its sharded parameters and gathers them in bf16."""
    return DTYPES[parameter_dtype(cfg.train.dtype, cfg.parallel.zero)]


class Mesh:
    """A layout's process groups: its sizes (`dp`, `tp`, ... read from `layout`) and, once built, the
    torch DeviceMesh they index.

    `Mesh.build` needs an initialised default process group; sub-meshes and groups are taken by name:
    pp, dp (= dp_replicate x dp_shard, flattened), dp_replicate, dp_shard, cp, tp, dp_cp, dp_shard_cp,
    dp_cp_tp (a pipeline stage's ranks; with train.optimizer=muon only), and the expert mesh's ep and edp
    (over dp*cp, or over dp*cp*tp with parallel.etp=1: `Layout.expert_ranks`)."""

    def __init__(self, layout: Layout | None = None, **sizes):
        self.layout = layout if layout is not None else Layout(**sizes)
        self.device_type = "cpu"
        self.device_mesh: Any = None  # (torch's DeviceMesh, once built)
        self.flat: dict = {}
        self.expert_mesh: Any = None
        self.cp_mesh: Any = None  # hybrid context parallelism: cp cut into (cp_ring, cp_ulysses)
        # Sub-meshes by name, each sliced once: DeviceMesh slicing builds a new mesh object every time
        # (a few ms), and the data-parallel code asks for the same few hundreds of times per run.
        self._sliced: dict[str, Any] = {}

    @classmethod
    def from_config(cls, cfg: Config, world: int) -> Mesh:
        return cls(Layout.from_config(cfg, world))

    dp = property(lambda self: self.layout.dp)
    tp = property(lambda self: self.layout.tp)
    pp = property(lambda self: self.layout.pp)
    cp = property(lambda self: self.layout.cp)
    ep = property(lambda self: self.layout.ep)
    dp_replicate = property(lambda self: self.layout.dp_replicate)
    dp_shard = property(lambda self: self.layout.dp_shard)
    world_size = property(lambda self: self.layout.world)
    edp = property(lambda self: self.layout.edp)  # ranks holding the same experts

    def build(self, device_type: str, timeout_s: float | None = None) -> Mesh:
        """Create every group; with `timeout_s`, a collective on any of them that does not complete in
        that time raises (torch's default for new groups would be 30 minutes, whatever the default
        group's timeout)."""
        self.device_type = device_type
        self._sliced = {}
        override = _backend_override(device_type, timeout_s)
        # Every mesh from the layout's rank lists (`Layout.rank_grid`: the one mesh order).
        self.device_mesh = self._device_mesh("main", override)
        # Experts: a stage's ranks cut into edp x ep x etp: dp*cp into ep groups of consecutive ranks
        # (ep innermost) and edp groups across, one such cut per tp rank; folded (parallel.etp=1),
        # a stage's dp*cp*tp ranks cut alike, so an ep group may span tp ranks ("etp" then has size 1).
        self.expert_mesh = self._device_mesh("expert", override)
        if self.layout.cp_mode == "hybrid" and self.cp > 1:  # Ulysses groups of consecutive cp ranks, rings across
            self.cp_mesh = self._device_mesh("cp", override)
        # Flattened views: "dp" picks the data (the batch split), "dp_cp" reduces gradients (cp ranks
        # see other tokens of the same sequences), "dp_shard_cp" holds the ZeRO shards.
        mesh = self.device_mesh
        flattened = ("dp", "dp_cp", "dp_shard_cp") + (("dp_cp_tp",) if self.layout.optimizer == "muon" else ())
        # (dp_cp_tp: only Muon's exchange uses it, and gloo connects a group eagerly)
        self.flat = {name: flatten_mesh(mesh[GROUP_DIMS[name][1]], name, override) for name in flattened}
        return self

    def _device_mesh(self, name: str, override: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        dims = MESHES[name]
        return DeviceMesh(
            self.device_type,
            self.layout.rank_grid(name),  # (DeviceMesh makes it a CPU tensor)
            mesh_dim_names=dims,
            backend_override=(override,) * len(dims) if override else None,
        )

    def __getitem__(self, name: str):
        if name not in self._sliced:
            self._sliced[name] = self._slice(name)
        return self._sliced[name]

    def _slice(self, name: str):
        if name in ("ep", "edp"):
            return self.expert_mesh[name]
        if name in ("cp_ring", "cp_ulysses"):
            return self.cp_mesh[name]
        return self.flat[name] if name in self.flat else self.device_mesh[name]

    def group(self, name: str):
        return self[name].get_group()

    def rank(self, name: str) -> int:
        return self[name].get_local_rank()

    def close(self) -> None:
        """Destroy every process group this mesh created, so that a process training run after run
        (the test suite, a notebook calling fived.api.train) holds only the live run's groups. A
        gloo group keeps its sockets and worker threads until its object is freed: DTensor's caches
        would hold it (emptied here); the caller frees what else refers to the mesh. The default
        group is the launcher's (DeviceMesh hands it out for a dimension spanning the world): never
        destroyed here. Idempotent; the mesh is unbuilt afterwards."""
        import torch.distributed as dist

        meshes = [m for m in (self.device_mesh, self.expert_mesh, self.cp_mesh, *self.flat.values()) if m is not None]
        created = {id(g): g for m in meshes for g in m.get_all_groups() if g is not dist.group.WORLD}
        self.device_mesh = self.expert_mesh = self.cp_mesh = None
        self.flat, self._sliced = {}, {}
        for group in created.values():
            dist.destroy_process_group(group)
        forget_dtensor_meshes()

    def group_names(self) -> dict:
        """ProcessGroup -> dimension name, for the communication ledger. When two dimensions have the
        same ranks (dp and dp_shard without replicas) the first listed names them."""
        names: dict = {}
        for d in GROUP_NAMES:
            if (d in ("cp_ring", "cp_ulysses") and self.cp_mesh is None) or (d == "dp_cp_tp" and d not in self.flat):
                continue  # (built only where used: hybrid context parallelism's groups, Muon's exchange)
            names.setdefault(self.group(d), d)
        return names


def _backend_override(device_type: str, timeout_s: float | None) -> Any:
    """(backend, options) carrying the collective timeout, for DeviceMesh's groups."""
    return None if timeout_s is None else process_group_options(device_type, timeout_s)
