"""The layout and the device mesh: `Layout` describes how one training step is laid out on the ranks
(the one description the runtime, `--report` and the planner share), `Mesh` builds a layout's process
groups, and `layout_errors` holds the checks that a layout can run, made before any rank starts.

Order, outermost to innermost: pp, dp, cp, tp (as Megatron-Core's rank generator: tp on the fastest
links, pp across nodes). dp is itself dp_replicate x dp_shard (HSDP: ZeRO shards within a dp_shard
group, replicas across dp_replicate); the flattened "dp" group spans both. Expert parallelism folds
over dp*cp (ep divides dp*cp).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, fields, replace

import torch

from fived.config import Config, ConfigError, ParallelConfig, TrainConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
CHECKPOINTING = ("none", "full", "selective")
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, V-shaped
SINGLE_STAGE = ("gpipe", "1f1b")
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")  # backward split into input- and weight-gradient passes


def stages_per_rank(schedule: str, virtual: int) -> int:
    return 2 if schedule in V_SHAPED else (1 if schedule in SINGLE_STAGE else virtual)


def resolve_dp(cfg: Config, world: int | None) -> int:
    """dp=-1 means 'the rest of the world': world / (tp*pp*cp)."""
    p = cfg.parallel
    if p.dp != -1:
        return p.dp
    model_parallel = max(p.tp, 1) * max(p.pp, 1) * max(p.cp, 1)
    if world is None or world % model_parallel:
        return 1 if world is None else -1
    return world // model_parallel


def nearest_multiple(value: int, base: int) -> int:
    """The multiple of `base` nearest to `value` (at least `base`; ties go up)."""
    base = max(base, 1)
    return max(base, round(value / base + 1e-9) * base) if value % base else value


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is at most `at_most` (1 if none larger)."""
    return max((d for d in range(1, max(at_most, 1) + 1) if n % d == 0), default=1)


def layout_errors(cfg: Config, world: int | None) -> list[ConfigError]:
    """Every rule a layout must meet, each with a concrete way out; the first error is reported."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dp = resolve_dp(cfg, world)
    errs: list[ConfigError] = []

    def need(ok: bool, field: str, value, rule: str, hint: str = ""):
        if not ok:
            errs.append(ConfigError(field, value, rule, hint))

    for name in ("tp", "pp", "cp", "ep"):
        need(getattr(p, name) >= 1, f"parallel.{name}", getattr(p, name), "must be >= 1", f"e.g. --{name} 1")
    need(p.dp >= 1 or p.dp == -1, "parallel.dp", p.dp, "must be >= 1 (or -1 to fill the world size)", "e.g. --dp 1")
    if errs:
        return errs
    model_parallel = p.tp * p.pp * p.cp
    if world is not None and dp == -1:
        need(False, "parallel", f"tp{p.tp}xpp{p.pp}xcp{p.cp}",
             f"tp*pp*cp={model_parallel} must divide the number of ranks ({world})")
        return errs
    if world is not None:
        need(dp * model_parallel == world, "parallel", f"dp{dp}xtp{p.tp}xpp{p.pp}xcp{p.cp}",
             f"dp*tp*pp*cp must equal the number of ranks ({world})")
    _tensor_rules(need, m, p)
    _pipeline_rules(need, m, p, t)
    _data_rules(need, m, p, t, dp)
    return errs


def _tensor_rules(need, m, p) -> None:
    need(m.n_heads % p.tp == 0, "parallel.tp", p.tp, f"must divide model.n_heads={m.n_heads}",
         f"e.g. --tp {largest_divisor(m.n_heads, p.tp)}")
    for name in ("ffn_dim", "moe_ffn_dim"):
        value = getattr(m, name)
        need(value % p.tp == 0, f"model.{name}", value, f"must be divisible by tp={p.tp}",
             f"e.g. --model.{name} {nearest_multiple(value, p.tp)}")
    need(m.n_kv_heads % p.tp == 0 or p.tp % m.n_kv_heads == 0, "parallel.tp", p.tp,
         f"must divide model.n_kv_heads={m.n_kv_heads} or be a multiple of it (kv heads are then replicated)",
         f"e.g. --tp {largest_divisor(m.n_kv_heads, p.tp)}")
    need(not p.sp or p.tp > 1, "parallel.sp", p.sp, "sequence parallelism splits over tp ranks: it needs tp > 1",
         "add --tp 2, or drop --sp")
    need(p.ep == 1 or m.is_moe, "parallel.ep", p.ep, f"needs a mixture-of-experts model (model.name={m.name} is dense)",
         "use --ep 1, or a MoE model such as --model tiny-moe")


def _pipeline_rules(need, m, p, t) -> None:
    need(p.pp == 1 or not m.tie_embeddings, "model.tie_embeddings", m.tie_embeddings,
         "tied embeddings across pipeline stages are not supported yet", "set it false, or use --pp 1")
    need(p.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", p.pp_schedule, "must be one of " + ", ".join(PP_SCHEDULES),
         "e.g. --pp-schedule 1f1b")
    if p.pp_schedule not in PP_SCHEDULES:
        return
    need(p.pp_virtual >= 1, "parallel.pp_virtual", p.pp_virtual, "must be >= 1", "e.g. --pp-virtual 2")
    need(p.pp_virtual == 1 or p.pp_schedule in ("interleaved-1f1b", "zero-bubble"), "parallel.pp_virtual",
         p.pp_virtual, f"only interleaved-1f1b and zero-bubble take virtual stages ({p.pp_schedule} uses "
         f"{stages_per_rank(p.pp_schedule, 1)} per rank)", "use --pp-virtual 1, or --pp-schedule interleaved-1f1b")
    per_rank = stages_per_rank(p.pp_schedule, max(p.pp_virtual, 1))
    stages = p.pp * per_rank if p.pp > 1 else 1
    need(m.n_layers >= stages, "parallel.pp", p.pp,
         f"{stages} pipeline stages need at least as many layers (model.n_layers={m.n_layers})",
         f"e.g. --pp {max(1, m.n_layers // per_rank)}")
    if p.pp_layers:
        try:
            counts = [int(c) for c in p.pp_layers.split(",")]
        except ValueError:
            counts = []
        even = [m.n_layers // stages + (1 if i < m.n_layers % stages else 0) for i in range(stages)]
        need(len(counts) == stages and all(c >= 1 for c in counts) and sum(counts) == m.n_layers,
             "parallel.pp_layers", p.pp_layers,
             f"must list {stages} positive layer counts summing to model.n_layers={m.n_layers}",
             f"e.g. --pp-layers {','.join(map(str, even))}" if m.n_layers >= stages else "")
    need(p.pp_schedule != "dualpipev" or p.pp == 1 or t.microbatches >= 2 * p.pp, "train.microbatches",
         t.microbatches, f"dualpipev needs at least as many micro-batches as stages (2*pp={2 * p.pp})",
         f"e.g. --microbatches {2 * p.pp}")
    need(p.pp == 1 or t.microbatches >= p.pp, "train.microbatches", t.microbatches, f"must be >= pp={p.pp}",
         f"e.g. --microbatches {p.pp}")
    need(p.pp == 1 or p.pp_schedule not in SPLIT_BACKWARD or t.activation_checkpointing != "selective",
         "train.activation_checkpointing", t.activation_checkpointing,
         f"selective checkpointing cannot run under {p.pp_schedule}: its split backward (input, then weight "
         f"gradients) would replay the cached ops twice, which torch refuses",
         "use --train.activation_checkpointing full, or --pp-schedule 1f1b/interleaved-1f1b")


def _data_rules(need, m, p, t, dp: int) -> None:
    dp_cp = max(dp, 1) * p.cp
    ep_ok = largest_divisor(math.gcd(m.n_experts, dp_cp) if m.is_moe else dp_cp, p.ep)
    need(not m.is_moe or m.n_experts % p.ep == 0, "parallel.ep", p.ep, f"must divide model.n_experts={m.n_experts}",
         f"e.g. --ep {ep_ok}")
    need(dp >= 1 and dp_cp % p.ep == 0, "parallel.ep", p.ep, f"must divide dp*cp={dp_cp}", f"e.g. --ep {ep_ok}")
    need(not p.sp or t.seq_len % (p.tp * p.cp) == 0, "train.seq_len", t.seq_len,
         f"must be divisible by tp*cp={p.tp * p.cp} with --sp", f"e.g. --seq-len {nearest_multiple(t.seq_len, p.tp * p.cp)}")
    need(t.seq_len % (2 * p.cp) == 0 or p.cp == 1, "train.seq_len", t.seq_len,
         f"must be divisible by 2*cp={2 * p.cp} (load-balanced context-parallel chunks)",
         f"e.g. --seq-len {nearest_multiple(t.seq_len, 2 * p.cp)}")
    need(p.zero in (0, 1, 2, 3), "parallel.zero", p.zero, "must be 0, 1, 2 or 3", "e.g. --zero 1")
    need(p.ep == 1 or p.dp_replicate == 1, "parallel.ep", p.ep, "expert parallelism with HSDP replicas is not supported yet",
         "use --ep 1, or --dp-replicate 1")
    need(p.dp_replicate >= 1 and dp >= 1 and dp % p.dp_replicate == 0, "parallel.dp_replicate", p.dp_replicate,
         f"must be >= 1 and divide dp={dp} (dp = dp_replicate x dp_shard)",
         f"e.g. --dp-replicate {largest_divisor(max(dp, 1), max(p.dp_replicate, 1))}")
    need(p.dp_replicate == 1 or p.zero >= 1, "parallel.dp_replicate", p.dp_replicate,
         "replica groups (HSDP) need a sharded stage", "add --zero 1 (or 2, 3)")
    need(p.reduce_dtype in ("float32", "bfloat16"), "parallel.reduce_dtype", p.reduce_dtype,
         "must be float32 or bfloat16", "e.g. --parallel.reduce_dtype float32")
    need(t.microbatches >= 1, "train.microbatches", t.microbatches, "must be >= 1", "e.g. --microbatches 1")
    need(dp >= 1 and t.global_batch % dp == 0, "train.global_batch", t.global_batch, f"must be divisible by dp={dp}",
         f"e.g. --global-batch {nearest_multiple(t.global_batch, max(dp, 1))}")
    if dp >= 1 and t.global_batch % dp == 0 and t.microbatches >= 1:
        local = t.global_batch // dp
        need(local % t.microbatches == 0, "train.microbatches", t.microbatches,
             f"must divide the per-rank batch global_batch/dp={local}",
             f"e.g. --microbatches {largest_divisor(local, t.microbatches)}")


def _model_errors(cfg: Config) -> list[ConfigError]:
    m, t, c = cfg.model, cfg.train, cfg.checkpoint
    checks = [
        (m.dim % m.n_heads == 0, "model.dim", m.dim, f"must be divisible by model.n_heads={m.n_heads}",
         f"e.g. --model.dim {nearest_multiple(m.dim, m.n_heads)}"),
        (m.n_heads % max(m.n_kv_heads, 1) == 0 and m.n_kv_heads >= 1, "model.n_kv_heads", m.n_kv_heads,
         f"must be >= 1 and divide model.n_heads={m.n_heads}",
         f"e.g. --model.n_kv_heads {largest_divisor(m.n_heads, max(m.n_kv_heads, 1))}"),
        (m.head_dim % 2 == 0, "model.dim", m.dim, "dim/n_heads must be even for rotary embeddings",
         f"e.g. --model.dim {nearest_multiple(m.dim, 2 * m.n_heads)}"),
        (not m.is_moe or 1 <= m.top_k <= m.n_experts, "model.top_k", m.top_k, f"must be in 1..n_experts={m.n_experts}",
         f"e.g. --model.top_k {min(2, max(m.n_experts, 1))}"),
        (t.dtype in DTYPES, "train.dtype", t.dtype, "must be one of " + ", ".join(DTYPES), "e.g. --dtype float32"),
        (t.device in ("auto", "cpu", "cuda"), "train.device", t.device, "must be auto, cpu or cuda",
         "e.g. --train.device auto"),
        (t.activation_checkpointing in CHECKPOINTING, "train.activation_checkpointing", t.activation_checkpointing,
         "must be one of " + ", ".join(CHECKPOINTING), "e.g. --train.activation_checkpointing none"),
        (t.steps >= 1, "train.steps", t.steps, "must be >= 1", "e.g. --steps 200"),
        (t.seq_len >= 2, "train.seq_len", t.seq_len, "must be >= 2", "e.g. --seq-len 64"),
        (t.global_batch >= 1, "train.global_batch", t.global_batch, "must be >= 1", "e.g. --global-batch 16"),
        (0 <= t.warmup_steps, "train.warmup_steps", t.warmup_steps, "must be >= 0", "e.g. --train.warmup_steps 20"),
        (t.lr > 0, "train.lr", t.lr, "must be > 0", "e.g. --train.lr 3e-3"),
        (t.collective_timeout_s > 0, "train.collective_timeout_s", t.collective_timeout_s, "must be > 0",
         "e.g. --train.collective_timeout_s 600"),
        (t.max_restarts >= 0, "train.max_restarts", t.max_restarts, "must be >= 0", "e.g. --max-restarts 2"),
        (t.preempt_grace_s >= 0, "train.preempt_grace_s", t.preempt_grace_s, "must be >= 0",
         "e.g. --train.preempt_grace_s 60"),
        (c.every >= 0, "checkpoint.every", c.every, "must be >= 0 (0: no periodic saves)", "e.g. --checkpoint.every 100"),
        (c.keep >= 0, "checkpoint.keep", c.keep, "must be >= 0 (0: keep all)", "e.g. --checkpoint.keep 3"),
    ]
    return [ConfigError(field, value, rule, hint) for ok, field, value, rule, hint in checks if not ok]


def suggest_layouts(cfg: Config, world: int, limit: int = 3) -> list[str]:
    """Valid (dp, tp, pp, cp, ep) layouts for `world` ranks, nearest to the requested one first."""
    p = cfg.parallel
    want = (resolve_dp(cfg, world), p.tp, p.pp, p.cp, p.ep)
    found = []
    for tp, pp, cp in itertools.product(range(1, world + 1), repeat=3):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        for ep in [e for e in range(1, dp * cp + 1) if (dp * cp) % e == 0]:
            trial = Config(model=cfg.model, train=cfg.train, data=cfg.data,
                           parallel=type(p)(**{**vars(p), "dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}))
            if not layout_errors(trial, world):
                dist = sum(abs(a - b) for a, b in zip((dp, tp, pp, cp, ep), want))
                found.append((dist, f"--dp {dp} --tp {tp} --pp {pp} --cp {cp} --ep {ep}"))
    return [s for _, s in sorted(found)[:limit]]


def check_config(cfg: Config, world: int | None) -> None:
    """Raise the first ConfigError for `cfg` on `world` ranks, with the nearest valid layouts as hint.
    Called by the CLI before any process starts, and again by every rank as a guard."""
    errs = _model_errors(cfg) or layout_errors(cfg, world)
    if not errs:
        return
    err = errs[0]
    if not err.hint:  # the world size does not fit the layout: other layouts, or another world size
        near = suggest_layouts(cfg, world) if world else []
        p = cfg.parallel
        ranks = max(p.dp, 1) * p.tp * p.pp * p.cp
        err = ConfigError(err.field, err.value, err.rule,
                          ("nearest valid layouts: " + " | ".join(near)) if near else f"e.g. --nproc {ranks}")
    raise err


P = ParallelConfig  # the layout fields' defaults: one source of truth, the config's


@dataclass(frozen=True)
class Layout:
    """A resolved `ParallelConfig` (dp a number, not -1) plus what the training config decides about the
    layout (sequences per micro-batch, activation checkpointing): every degree of freedom the runtime
    has, hashable, so the planner can weigh thousands of them and a planned one runs as printed.
    `etp` (expert tensor-parallel size; 0 means tp, as fived runs experts) is the planner's only field
    beyond the runtime's: Megatron-Core's MoE parallel folding, which fived cannot run yet."""

    dp: int = 1
    tp: int = P.tp
    pp: int = P.pp
    cp: int = P.cp
    ep: int = P.ep
    zero: int = P.zero
    dp_replicate: int = P.dp_replicate
    reduce_dtype: str = P.reduce_dtype
    zero3_keep_gathered: bool = P.zero3_keep_gathered
    sp: bool = P.sp
    pp_schedule: str = P.pp_schedule
    pp_virtual: int = P.pp_virtual
    pp_layers: str = P.pp_layers
    micro_batch: int = 1  # sequences per micro-batch on one data-parallel rank
    checkpointing: str = TrainConfig.activation_checkpointing
    etp: int = 0

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def n_stages(self) -> int:
        return self.pp * stages_per_rank(self.pp_schedule, self.pp_virtual) if self.pp > 1 else 1

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def runnable(self) -> bool:
        """fived's runtime can run it: experts split like the attention (etp = tp), ep over dp*cp."""
        return self.expert_tp == self.tp

    @classmethod
    def from_config(cls, cfg: Config, world: int | None) -> "Layout":
        """The layout a `Config` runs on `world` ranks."""
        dp = resolve_dp(cfg, world)
        t = cfg.train
        return cls(**{f.name: getattr(cfg.parallel, f.name) for f in fields(ParallelConfig)} | {
            "dp": dp, "micro_batch": max(1, t.global_batch // (max(dp, 1) * t.microbatches)),
            "checkpointing": t.activation_checkpointing})

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(**{f.name: getattr(self, f.name) for f in fields(ParallelConfig)})

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits on the mesh (MESH_DIMS order, tp innermost): its pipeline rank, its
        index in the dp_shard x cp ZeRO group and in its expert-data group (dp x cp cut into ep groups
        of consecutive ranks)."""
        rest, tp_i = divmod(rank, self.tp)
        rest, cp_i = divmod(rest, self.cp)
        rest, dps_i = divmod(rest, self.dp_shard)
        pp_i, dpr_i = divmod(rest, self.dp_replicate)
        dp_cp = (dpr_i * self.dp_shard + dps_i) * self.cp + cp_i
        return {"pp": pp_i, "shard": dps_i * self.cp + cp_i, "edp": dp_cp // self.ep}

    def group_ranks(self, name: str, rank: int = 0) -> frozenset[int]:
        """The global ranks of `rank`'s group `name` (a GROUP_NAMES entry), as `Mesh.build` forms it."""
        varied = {"pp": "p", "dp": "rs", "dp_replicate": "r", "dp_shard": "s", "cp": "c", "tp": "t", "dp_cp": "rsc",
                  "dp_shard_cp": "sc", "ep": "e", "edp": "d"}[name]

        def coords(r: int) -> dict[str, int]:
            rest, t = divmod(r, self.tp)
            rest, c = divmod(rest, self.cp)
            rest, s = divmod(rest, self.dp_shard)
            p, d = divmod(rest, self.dp_replicate)
            flat = (d * self.dp_shard + s) * self.cp + c  # the expert mesh cuts dp*cp into (edp, ep)
            return {"p": p, "r": d, "s": s, "c": c, "t": t, "d": flat // self.ep, "e": flat % self.ep,
                    "x": flat}

        def key(r: int) -> tuple:
            k = coords(r)
            if name in ("ep", "edp"):  # the expert mesh's other coordinate is its own
                return k["p"], k["t"], k["d" if name == "ep" else "e"]
            return tuple(v for dim, v in k.items() if dim in "prsct" and dim not in varied)

        mine = key(rank)
        return frozenset(r for r in range(self.world) if key(r) == mine)

    def ledger_name(self, group: str) -> str:
        """The name the communication ledger gives `group` ('dp_cp' is 'dp' without context
        parallelism): the first of GROUP_NAMES with the same ranks."""
        ranks = self.group_ranks(group)
        return next(n for n in GROUP_NAMES if self.group_ranks(n) == ranks)

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step on each data-parallel rank (global_batch in sequences)."""
        return global_batch // (self.dp * self.micro_batch)

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)

    def overrides(self, global_batch: int) -> dict:
        """The config overrides that run this layout (`fived train --section.field value ...`): the
        sizes always, other parallel fields where they differ from the defaults."""
        always = ("dp", "tp", "pp", "cp", "ep", "zero", "dp_replicate", "sp")
        out = {f"parallel.{f.name}": getattr(self, f.name) for f in fields(ParallelConfig)
               if f.name in always or (self.pp > 1 and f.name in ("pp_schedule", "pp_virtual"))
               or getattr(self, f.name) != f.default}
        out["train.microbatches"] = self.microbatches(global_batch)
        out["train.global_batch"] = global_batch
        out["train.activation_checkpointing"] = self.checkpointing
        return out

    def flags(self, global_batch: int) -> str:
        return " ".join(f"--{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in self.overrides(global_batch).items())

    def describe(self) -> str:
        parts = [f"dp{self.dp}"]
        if self.dp_replicate > 1:
            parts[0] += f"(={self.dp_replicate}x{self.dp_shard} HSDP)"
        parts.append(f"ZeRO-{self.zero}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sp else ""))
        if self.pp > 1:
            v = stages_per_rank(self.pp_schedule, self.pp_virtual)
            parts.append(f"pp{self.pp} {self.pp_schedule}" + (f" v{v}" if v > 1 else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f" etp{self.expert_tp}" if not self.runnable else ""))
        parts.append(f"mbs{self.micro_batch}")
        if self.checkpointing != "none":
            parts.append(f"ac={self.checkpointing}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


class Mesh:
    """A layout's process groups: its sizes (`dp`, `tp`, ... read from `layout`) and, once built, the
    torch DeviceMesh they index.

    `Mesh.build` needs an initialised default process group; sub-meshes and groups are taken by name:
    pp, dp (= dp_replicate x dp_shard, flattened), dp_replicate, dp_shard, cp, tp, dp_cp, dp_shard_cp,
    and the expert mesh's ep and edp."""

    def __init__(self, layout: Layout | None = None, **sizes):
        self.layout = layout if layout is not None else Layout(**sizes)
        self.device_type = "cpu"
        self.device_mesh = None
        self.flat: dict = {}
        self.expert_mesh = None

    @classmethod
    def from_config(cls, cfg: Config, world: int) -> "Mesh":
        return cls(Layout.from_config(cfg, world))

    dp = property(lambda self: self.layout.dp)
    tp = property(lambda self: self.layout.tp)
    pp = property(lambda self: self.layout.pp)
    cp = property(lambda self: self.layout.cp)
    ep = property(lambda self: self.layout.ep)
    dp_replicate = property(lambda self: self.layout.dp_replicate)
    dp_shard = property(lambda self: self.layout.dp_shard)
    world_size = property(lambda self: self.layout.world)

    def build(self, device_type: str, timeout_s: float | None = None) -> "Mesh":
        """Create every group; with `timeout_s`, a collective on any of them that does not complete in
        that time raises (torch's default for new groups would be 30 minutes, whatever the default
        group's timeout)."""
        from torch.distributed.device_mesh import init_device_mesh

        self.device_type = device_type
        override = _backend_override(device_type, timeout_s)
        dims = {name: override for name in MESH_DIMS} if override else None
        self.device_mesh = init_device_mesh(
            device_type, tuple(getattr(self, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS, backend_override=dims)
        # Flattened views: "dp" picks the data (the batch split), "dp_cp" reduces gradients (cp ranks
        # see other tokens of the same sequences), "dp_shard_cp" holds the ZeRO shards.
        mesh = self.device_mesh
        # Experts: dp*cp cut into ep groups of consecutive ranks (ep innermost) and edp groups across.
        expert_dims = ("pp", "edp", "ep", "tp")
        self.expert_mesh = init_device_mesh(
            device_type, (self.pp, self.dp * self.cp // self.ep, self.ep, self.tp), mesh_dim_names=expert_dims,
            backend_override={name: override for name in expert_dims} if override else None)
        self.flat = {"dp": mesh["dp_replicate", "dp_shard"]._flatten("dp", backend_override=override),
                     "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp", backend_override=override),
                     "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp", backend_override=override)}
        return self

    def __getitem__(self, name: str):
        if name in ("ep", "edp"):
            return self.expert_mesh[name]
        return self.flat[name] if name in self.flat else self.device_mesh[name]

    def group(self, name: str):
        return self[name].get_group()

    def rank(self, name: str) -> int:
        return self[name].get_local_rank()

    def group_names(self) -> dict:
        """ProcessGroup -> dimension name, for the communication ledger. When two dimensions have the
        same ranks (dp and dp_shard without replicas) the first listed names them."""
        names: dict = {}
        for d in GROUP_NAMES:
            names.setdefault(self.group(d), d)
        return names


def _backend_override(device_type: str, timeout_s: float | None):
    """(backend, options) carrying the collective timeout, for DeviceMesh's groups."""
    if timeout_s is None:
        return None
    import datetime

    import torch.distributed as dist

    if device_type == "cuda":
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return backend, options


# The named groups, in the order the ledger prefers a name when two groups hold the same ranks.
GROUP_NAMES = ("dp", "cp", "tp", "pp", "ep", "dp_shard", "dp_replicate", "dp_cp", "dp_shard_cp", "edp")
