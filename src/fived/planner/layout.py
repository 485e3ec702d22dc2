"""A layout: how one training step is laid out on the GPUs, the planner's unit of choice.

It names every degree of freedom the runtime has (mesh sizes, ZeRO stage, HSDP replicas, sequence
parallelism, pipeline schedule and virtual stages, micro-batch size, activation checkpointing) and
turns into the `--section.field` overrides `fived train` takes, so a planned layout is run as printed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from fived.mesh import stages_per_rank


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    dp_replicate: int = 1
    sp: bool = False
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    micro_batch: int = 1  # sequences per micro-batch on one data-parallel rank
    checkpointing: str = "none"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def n_stages(self) -> int:
        return self.pp * stages_per_rank(self.pp_schedule, self.pp_virtual) if self.pp > 1 else 1

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @classmethod
    def from_config(cls, cfg, world: int) -> "Layout":
        """The layout a `Config` runs on `world` ranks."""
        from fived.mesh import resolve_dp

        p, t = cfg.parallel, cfg.train
        dp = resolve_dp(cfg, world)
        return cls(dp=dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero=p.zero, dp_replicate=p.dp_replicate, sp=p.sp,
                   pp_schedule=p.pp_schedule, pp_virtual=p.pp_virtual,
                   micro_batch=max(1, t.global_batch // (dp * t.microbatches)),
                   checkpointing=t.activation_checkpointing)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global `rank` sits on the mesh (pp, dp_replicate, dp_shard, cp, tp; tp innermost):
        its pipeline rank, its index in the dp_shard x cp ZeRO group and in its expert-data group
        (dp x cp cut into ep groups of consecutive ranks)."""
        rest, tp_i = divmod(rank, self.tp)
        rest, cp_i = divmod(rest, self.cp)
        rest, dps_i = divmod(rest, self.dp_shard)
        pp_i, dpr_i = divmod(rest, self.dp_replicate)
        dp_cp = (dpr_i * self.dp_shard + dps_i) * self.cp + cp_i
        return {"pp": pp_i, "shard": dps_i * self.cp + cp_i, "edp": dp_cp // self.ep}

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step on each data-parallel rank (global_batch in sequences)."""
        return global_batch // (self.dp * self.micro_batch)

    def with_(self, **changes) -> "Layout":
        return replace(self, **changes)

    def overrides(self, global_batch: int) -> dict:
        """The config overrides that run this layout (`fived train --section.field value ...`)."""
        out = {f"parallel.{k}": getattr(self, k) for k in ("dp", "tp", "pp", "cp", "ep", "zero", "dp_replicate", "sp")}
        if self.pp > 1:
            out.update({"parallel.pp_schedule": self.pp_schedule, "parallel.pp_virtual": self.pp_virtual})
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
            parts.append(f"ep{self.ep}")
        parts.append(f"mbs{self.micro_batch}")
        if self.checkpointing != "none":
            parts.append(f"ac={self.checkpointing}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)
