"""The layout: how one training step is laid out on the ranks — the one description the runtime,
`--report` and the planner share — with the names of its choices (schedules, checkpointing,
precisions) and the way ranks are numbered on the mesh.

Mesh order, outermost to innermost: pp, dp, cp, tp (as Megatron-Core's rank generator: tp on the
fastest links, pp across nodes). dp is itself dp_replicate x dp_shard (HSDP: ZeRO shards within a
dp_shard group, replicas across dp_replicate); the flattened "dp" group spans both. Expert
parallelism folds over dp*cp (ep divides dp*cp), or with parallel.etp=1 (MoE parallel folding) over a
stage's dp*cp*tp ranks, whole experts on each (ep divides dp*cp*tp). Plain Python: `fived.parallel.mesh.Mesh` builds the
process groups of a layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from operator import attrgetter
from typing import get_args

from fived.config import (
    Checkpointing,
    CompileBackend,
    Config,
    CpBalance,
    CpMode,
    DataConfig,
    Fp8Recipe,
    MuonScale,
    Optimizer,
    ParallelConfig,
    PPSchedule,
    ReduceDtype,
    TrainConfig,
    ZeroStage,
)

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The layout fields every mesh dimension's size (MESHES) is computed from (`Layout.mesh_key`)
MESH_FIELDS = ("dp", "tp", "pp", "cp", "ep", "etp", "dp_replicate", "cp_mode", "cp_ulysses")
_mesh_values = attrgetter(*MESH_FIELDS)  # (in C: caches ask a layout for it ~10^6 times a search)
PP_SCHEDULES = get_args(PPSchedule)
CHECKPOINTING = get_args(Checkpointing)
FP8_RECIPES = get_args(Fp8Recipe)  # train.fp8: torchao's float8 training recipes
EP_OVERLAP_CHUNKS = 2  # parallel.ep_overlap: the routed slots' chunks (fived.parallel.expert_overlap)
COMPILE_BACKENDS = get_args(CompileBackend)  # train.compile_backend (fived.parallel.compile)
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, V-shaped
SINGLE_STAGE = ("gpipe", "1f1b")
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")  # backward split into input- and weight-gradient passes
# The named groups, in the order the ledger prefers a name when two groups hold the same ranks.
# dp_cp_tp: every rank of one pipeline stage (Muon's exchange of whole matrices, fived.layout.muon_plan).
# cp_ulysses, cp_ring: hybrid context parallelism's Ulysses groups and the ring across them.
GROUP_NAMES = (
    "dp",
    "cp",
    "tp",
    "pp",
    "ep",
    "dp_shard",
    "dp_replicate",
    "dp_cp",
    "dp_shard_cp",
    "edp",
    "dp_cp_tp",
    "cp_ulysses",
    "cp_ring",
)
# The meshes a layout's groups are cut from (`fived.parallel.mesh.Mesh` builds each from `Layout.rank_grid`),
# outermost dimension first: all three number the ranks alike (tp, then cp, dp_shard, dp_replicate,
# pp); the expert mesh cuts a stage's ranks into edp x ep x etp (etp 1 when folded: ep spans tp), the
# hybrid context-parallel mesh cuts cp into rings across Ulysses groups of consecutive cp ranks.
MESHES = {
    "main": MESH_DIMS,
    "expert": ("pp", "edp", "ep", "etp"),
    "cp": ("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "tp"),
}
# Each named group: its mesh and the dimensions it spans (flattened, the last innermost).
GROUP_DIMS = {
    "pp": ("main", ("pp",)),
    "dp": ("main", ("dp_replicate", "dp_shard")),
    "dp_replicate": ("main", ("dp_replicate",)),
    "dp_shard": ("main", ("dp_shard",)),
    "cp": ("main", ("cp",)),
    "tp": ("main", ("tp",)),
    "dp_cp": ("main", ("dp_replicate", "dp_shard", "cp")),
    "dp_shard_cp": ("main", ("dp_shard", "cp")),
    "dp_cp_tp": ("main", ("dp_replicate", "dp_shard", "cp", "tp")),
    "ep": ("expert", ("ep",)),
    "edp": ("expert", ("edp",)),
    "cp_ulysses": ("cp", ("cp_ulysses",)),
    "cp_ring": ("cp", ("cp_ring",)),
}
OPTIMIZERS = get_args(Optimizer)  # train.optimizer (fived.optim.adamw, fived.optim.muon)
MUON_SCALES = get_args(MuonScale)  # train.muon_scale (fived.optim.muon.update_scale)
CP_MODES = get_args(CpMode)  # parallel.cp_mode
CP_BALANCES = get_args(CpBalance)  # parallel.cp_balance


@dataclass(frozen=True)
class PrecisionSpec:
    """What a `train.dtype` means, by dtype name: the dtype the model's parameters and gradients are
    held in, the dtype matmuls run in (autocast when it differs from the weights'), and whether the
    optimizer keeps float32 master weights (with Adam's state) of low-precision parameters."""

    weights: str
    compute: str
    master: bool = False

    @property
    def autocast(self) -> bool:
        return self.compute != self.weights

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.weights]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
# train.dtype -> PrecisionSpec. "bfloat16": bf16 parameters and gradients, float32 master weights and
# Adam state in the optimizer (sharded like it under ZeRO-1/2/3); "bfloat16-autocast": float32
# weights, gradients and Adam state, matmuls in bf16 under autocast.
PRECISION_SPECS = {
    "float32": PrecisionSpec("float32", "float32"),
    "bfloat16": PrecisionSpec("bfloat16", "bfloat16", master=True),
    "bfloat16-autocast": PrecisionSpec("float32", "bfloat16"),
    "float64": PrecisionSpec("float64", "float64"),
}


def masters_apart(dtype: str, zero: int) -> bool:
    """Whether the optimizer keeps float32 master weights apart from the parameters: low-precision
    parameters (`PrecisionSpec.master`) outside ZeRO-3; under ZeRO-3 FSDP2's float32 sharded
    parameters are the masters themselves (gathered in the precision's weights dtype)."""
    return PRECISION_SPECS[dtype].master and zero != 3


def parameter_dtype(dtype: str, zero: int) -> str:
    """The dtype the model's parameters are built and held in: the precision's weights, except under
    ZeRO-3 in runs with masters, whose float32 masters are the (sharded) parameters."""
    spec = PRECISION_SPECS[dtype]
    return "float32" if spec.master and zero == 3 else spec.weights


def keeps_flat_buffer(zero: int, pp: int, dp_cp_size: int) -> bool:
    """Whether parameters live in the flat buffer (`fived.parallel.zero`): under ZeRO-1/2, and ZeRO-0
    under a pipeline with more than one dp*cp rank; ZeRO-0 otherwise keeps them whole (DDP, or a
    single data-parallel rank), ZeRO-3 as rows (FSDP2)."""
    return zero in (1, 2) or (zero == 0 and pp > 1 and dp_cp_size > 1)


def stages_per_rank(schedule: str, virtual: int) -> int:
    return 2 if schedule in V_SHAPED else (1 if schedule in SINGLE_STAGE else virtual)


def resolve_dp(cfg: Config, world: int | None) -> int:
    """dp=-1 means 'the rest of the world': world / (tp*pp*cp)."""
    return parallel_dp(cfg.parallel, world)


def parallel_dp(p: ParallelConfig | Layout, world: int | None) -> int:
    """`resolve_dp` of a config's `parallel` section (or a `Layout`: the same fields)."""
    if p.dp != -1:
        return p.dp
    model_parallel = max(p.tp, 1) * max(p.pp, 1) * max(p.cp, 1)
    if world is None or world % model_parallel:
        return 1 if world is None else -1
    return world // model_parallel


P = ParallelConfig  # the layout fields' defaults: one source of truth, the config's


@dataclass(frozen=True)
class Layout:
    """A resolved `ParallelConfig` (dp a number, not -1) plus what the training config decides about the
    layout (sequences per micro-batch, activation checkpointing, the optimizer): every degree of freedom the runtime
    has, hashable, so the planner can weigh thousands of them and a planned one runs as printed.
    `etp` (expert tensor-parallel size) is 0 (experts split over tp like the attention) or 1 (MoE
    parallel folding: whole experts, ep over dp*cp*tp) for the runtime; the planner also weighs other
    runtimes' values, which fived does not run."""

    dp: int = 1
    tp: int = P.tp
    pp: int = P.pp
    cp: int = P.cp
    ep: int = P.ep
    zero: ZeroStage = P.zero
    dp_replicate: int = P.dp_replicate
    reduce_dtype: ReduceDtype = P.reduce_dtype
    zero3_keep_gathered: bool = P.zero3_keep_gathered
    sp: bool = P.sp
    pp_schedule: PPSchedule = P.pp_schedule
    pp_virtual: int = P.pp_virtual
    pp_layers: str = P.pp_layers
    tp_overlap: bool = P.tp_overlap
    overlap_grad_reduce: bool = P.overlap_grad_reduce
    overlap_param_gather: bool = P.overlap_param_gather
    zero2_reduce_every_microbatch: bool = P.zero2_reduce_every_microbatch
    bucket_mb: float = P.bucket_mb
    ep_overlap: bool = P.ep_overlap
    etp: int = P.etp
    cp_mode: CpMode = P.cp_mode
    cp_ulysses: int = P.cp_ulysses
    cp_balance: CpBalance = P.cp_balance
    micro_batch: int = 1  # sequences per micro-batch on one data-parallel rank
    checkpointing: Checkpointing = TrainConfig.activation_checkpointing
    optimizer: Optimizer = TrainConfig.optimizer  # muon: its state and its exchange of whole matrices are priced
    muon_bucket_mb: float = TrainConfig.muon_bucket_mb  # (Muon's step in buckets: fived.layout.muon_plan)
    muon_ns_steps: int = TrainConfig.muon_ns_steps  # (Newton-Schulz iterations: its time is priced)
    document_mask: bool = DataConfig.document_mask  # (data.document_mask: what the attention masks)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def bucket_elements(self, element_bytes: int) -> int | None:
        """Elements per ZeRO-1/2 flat-buffer bucket (None: one bucket, when nothing overlaps)."""
        if not (self.overlap_grad_reduce or self.overlap_param_gather):
            return None
        return max(1, int(self.bucket_mb * 2**20) // element_bytes)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def dp_cp(self) -> int:
        """Ranks of the gradient reduction's group dp x cp (cp ranks see other tokens of the sequences)."""
        return self.dp * self.cp

    @property
    def shards(self) -> int:
        """The ZeRO shard group dp_shard x cp: what ZeRO-1/2's flat buffer and ZeRO-3's rows are cut over."""
        return self.dp_shard * self.cp

    @property
    def stage_ranks(self) -> int:
        """The ranks of one pipeline stage, dp x cp x tp."""
        return self.dp * self.cp * self.tp

    @property
    def flat_buffer(self) -> bool:
        """Whether the runtime keeps the non-expert parameters in a flat buffer (`keeps_flat_buffer`)."""
        return keeps_flat_buffer(self.zero, self.pp, self.dp_cp)

    def masters_apart(self, dtype: str) -> bool:
        """Whether the optimizer keeps float32 masters apart from the parameters (`masters_apart`)."""
        return masters_apart(dtype, self.zero)

    @property
    def n_stages(self) -> int:
        return self.pp * stages_per_rank(self.pp_schedule, self.pp_virtual) if self.pp > 1 else 1

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def folded(self) -> bool:
        """MoE parallel folding that changes anything: whole experts where the attention is tp-split."""
        return self.etp == 1 and self.tp > 1

    @property
    def expert_ranks(self) -> int:
        """The ranks of a pipeline stage that ep x edp cut: dp*cp, or dp*cp*tp when folded."""
        return self.dp * self.cp * (self.tp if self.folded else 1)

    @property
    def edp(self) -> int:
        """Ranks holding the same routed experts: a stage's ranks over ep x the experts' tp size, which
        is `expert_ranks // ep` for fived's runtime (etp 0 or 1) and other runtimes' etp alike."""
        return self.stage_ranks // (self.ep * self.expert_tp)

    def expert_index(self, dp_cp: int, tp: int) -> int:
        """A rank's index among `expert_ranks` from its dp*cp and tp indices (tp innermost when folded):
        its ep rank is index % ep, its edp rank index // ep."""
        return dp_cp * self.tp + tp if self.folded else dp_cp

    @property
    def ulysses(self) -> int:
        """Ranks per Ulysses group: cp (ulysses), cp_ulysses (hybrid), 1 (ring, or no cp)."""
        if self.cp == 1:
            return 1
        return {"ulysses": self.cp, "hybrid": self.cp_ulysses}.get(self.cp_mode, 1)

    @property
    def runnable(self) -> bool:
        """fived's runtime can run it: experts split like the attention (etp 0), or folded (etp 1)."""
        return self.etp in (0, 1)

    @classmethod
    def from_config(cls, cfg: Config, world: int | None) -> Layout:
        """The layout a `Config` runs on `world` ranks."""
        dp = resolve_dp(cfg, world)
        t = cfg.train
        return cls(
            **{f.name: getattr(cfg.parallel, f.name) for f in fields(ParallelConfig)}
            | {
                "dp": dp,
                "micro_batch": max(1, t.global_batch // (max(dp, 1) * t.microbatches)),
                "checkpointing": t.activation_checkpointing,
                "optimizer": t.optimizer,
                "muon_bucket_mb": t.muon_bucket_mb,
                "muon_ns_steps": t.muon_ns_steps,
                "document_mask": cfg.data.document_mask,
            }
        )

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(**{name: getattr(self, name) for name in _PARALLEL_FIELDS})

    def dim_size(self, dim: str) -> int:
        """The size of mesh dimension `dim` (of one of MESHES)."""
        if dim in ("edp", "etp", "cp_ring", "cp_ulysses"):
            return {"edp": self.edp, "etp": self.expert_tp, "cp_ring": self.cp // self.ulysses}.get(dim, self.ulysses)
        return int(getattr(self, dim))

    def strides(self, mesh: str) -> dict[str, int]:
        """The rank distance between neighbours along each dimension of mesh `mesh` (MESHES: its last
        dimension innermost, every mesh numbering the ranks in the same order)."""
        out, step = {}, 1
        for dim in reversed(MESHES[mesh]):
            out[dim], step = step, step * self.dim_size(dim)
        return out

    def mesh_coordinates(self, rank: int, mesh: str = "main") -> dict[str, int]:
        """Global `rank`'s index along each dimension of mesh `mesh`."""
        return {dim: rank // stride % self.dim_size(dim) for dim, stride in self.strides(mesh).items()}

    def rank_grid(self, mesh: str) -> list:
        """The ranks of mesh `mesh` as nested lists, outermost dimension first (`Mesh.build`'s meshes)."""
        strides = self.strides(mesh)

        def grid(dims: tuple[str, ...], base: int) -> list | int:
            if not dims:
                return base
            return [grid(dims[1:], base + i * strides[dims[0]]) for i in range(self.dim_size(dims[0]))]

        out = grid(MESHES[mesh], 0)
        assert isinstance(out, list)
        return out

    def span(self, group: str) -> tuple[int, int]:
        """(ranks in group `group`, the rank distance between its neighbours)."""
        return _span(self.mesh_key, group)

    @property
    def mesh_key(self) -> tuple:
        """The fields the ranks' arrangement depends on (MESH_FIELDS' values): what caches of a
        group's size and stride key on."""
        return _mesh_values(self)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits: its pipeline rank, its index among its stage's ranks (dp_cp_tp),
        in the dp_shard x cp ZeRO group and in its expert-data group."""
        return {
            "pp": self.mesh_coordinates(rank)["pp"],
            "member": self.group_index("dp_cp_tp", rank),
            "shard": self.group_index("dp_shard_cp", rank),
            "edp": self.mesh_coordinates(rank, "expert")["edp"],
        }

    def group_index(self, group: str, rank: int) -> int:
        """`rank`'s index in its group `group` (the group's dimensions flattened, the last innermost)."""
        mesh, dims = GROUP_DIMS[group]
        where = self.mesh_coordinates(rank, mesh)
        index = 0
        for dim in dims:
            index = index * self.dim_size(dim) + where[dim]
        return index

    def group_ranks(self, name: str, rank: int = 0) -> frozenset[int]:
        """The global ranks of `rank`'s group `name` (a GROUP_NAMES entry), as `Mesh.build` forms it:
        the ranks that differ from `rank` only along the group's dimensions of its mesh."""
        mesh, dims = GROUP_DIMS[name]
        strides, where = self.strides(mesh), self.mesh_coordinates(rank, mesh)
        base = rank - sum(where[d] * strides[d] for d in dims)
        offsets = [0]
        for dim in dims:
            offsets = [o + i * strides[dim] for o in offsets for i in range(self.dim_size(dim))]
        return frozenset(base + o for o in offsets)

    def ledger_name(self, group: str) -> str:
        """The name the communication ledger gives `group` ('dp_cp' is 'dp' without context
        parallelism): the first of GROUP_NAMES with the same ranks."""
        ranks = self.group_ranks(group)
        return next(n for n in GROUP_NAMES if self.group_ranks(n) == ranks)

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step on each data-parallel rank (global_batch in sequences)."""
        return global_batch // (self.dp * self.micro_batch)

    def with_(self, **changes) -> Layout:
        """`dataclasses.replace`, without its per-field work (the planner derives ~10^5 layouts a search;
        no field has an initialiser's check to rerun)."""
        if not changes.keys() <= _FIELD_NAMES:
            return replace(self, **changes)  # (its TypeError names the unknown field)
        out = object.__new__(Layout)
        out.__dict__.update(self.__dict__)
        out.__dict__.update(changes)
        return out

    def overrides(self, global_batch: int) -> dict:
        """The config overrides that run this layout (`fived train --section.field value ...`): the
        sizes always, other parallel fields where they differ from the defaults."""
        always = _ALWAYS_FLAGS | (_PIPELINE_FLAGS if self.pp > 1 else frozenset())
        out = {}
        for name, default in _PARALLEL_DEFAULTS:
            value = getattr(self, name)
            if name in always or value != default:
                out[f"parallel.{name}"] = value
        out["train.microbatches"] = self.microbatches(global_batch)
        out["train.global_batch"] = global_batch
        out["train.activation_checkpointing"] = self.checkpointing
        if self.optimizer != TrainConfig.optimizer:
            out["train.optimizer"] = self.optimizer
        for name in ("muon_bucket_mb", "muon_ns_steps"):
            if getattr(self, name) != getattr(TrainConfig, name):
                out[f"train.{name}"] = getattr(self, name)
        if self.document_mask:
            out["data.document_mask"] = True
        return out

    def flag_pairs(self, global_batch: int) -> list[str]:
        """`flags`' "--name value" pairs, in order."""
        return [
            f"--{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in self.overrides(global_batch).items()
        ]

    def flags(self, global_batch: int) -> str:
        return " ".join(self.flag_pairs(global_batch))

    def describe(self) -> str:
        parts = [f"dp{self.dp}"]
        if self.dp_replicate > 1:
            parts[0] += f"(={self.dp_replicate}x{self.dp_shard} HSDP)"
        parts.append(f"ZeRO-{self.zero}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sp else ""))
        if self.pp > 1:  # (v: the flag's pp_virtual; zbv's and dualpipev's two stages a rank are the schedule's)
            parts.append(f"pp{self.pp} {self.pp_schedule}" + (f" v{self.pp_virtual}" if self.pp_virtual > 1 else ""))
        if self.cp > 1:
            mode = {"ring": "", "ulysses": " ulysses", "hybrid": f" hybrid(ulysses{self.ulysses})"}.get(
                self.cp_mode, ""
            )
            parts.append(f"cp{self.cp}{mode}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f" etp{self.expert_tp}" if self.expert_tp != self.tp else ""))
        parts.append(f"mbs{self.micro_batch}")
        if self.checkpointing != "none":
            parts.append(f"ac={self.checkpointing}")
        if self.optimizer != TrainConfig.optimizer:
            parts.append(self.optimizer)
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


_FIELD_NAMES = frozenset(f.name for f in fields(Layout))
# `Layout.overrides`' flags: the parallel fields in the config's order with their defaults (read once),
# those always written, and those written under a pipeline
_PARALLEL_DEFAULTS = tuple((f.name, f.default) for f in fields(ParallelConfig))
_ALWAYS_FLAGS = frozenset(("dp", "tp", "pp", "cp", "ep", "zero", "dp_replicate", "sp"))
_PIPELINE_FLAGS = frozenset(("pp_schedule", "pp_virtual"))
_PARALLEL_FIELDS = tuple(f.name for f in fields(ParallelConfig))  # (`dataclasses.fields` is slow: asked per layout)


@lru_cache(maxsize=16384)
def _span(mesh_key: tuple, group: str) -> tuple[int, int]:
    """`Layout.span`: it depends only on the mesh (memoised: a search asks for it per layout)."""
    L = Layout(**dict(zip(MESH_FIELDS, mesh_key)))
    mesh, dims = GROUP_DIMS[group]
    return math.prod(L.dim_size(d) for d in dims), L.strides(mesh)[dims[-1]]
