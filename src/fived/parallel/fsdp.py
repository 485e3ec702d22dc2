"""ZeRO-3 with FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over
dp_shard; each transformer block's parameters gathered just before use (the next block's gather is
prefetched) and freed after; gradients reduce-scattered once per step. HSDP when dp_replicate > 1:
a 2-d mesh (dp_replicate, dp_shard), shards within a group, all-reduce across groups.

Gradient accumulation: gradients are reduced only on the last micro-batch. With
`parallel.zero3_keep_gathered` the gathered weights also stay through the series of micro-batches
(one gather per step instead of one per micro-batch, at the cost of holding the whole model
unsharded meanwhile) — what a pipeline schedule wants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from fived.layout.spec import Stored, TensorSpec
from fived.model.transformer import MoE, Transformer
from fived.parallel import comm
from fived.parallel.data_parallel import DataParallel

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class FullyShardedDataParallel(DataParallel):
    experts_apart = False  # sharded over edp by FSDP itself

    def shard(self, chunks: list[Transformer]) -> None:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if self.mesh.dp_replicate > 1:
            mesh = self.mesh.device_mesh["dp_replicate", "dp_shard_cp"]
        else:
            mesh = self.mesh["dp_shard_cp"]
        mp = MixedPrecisionPolicy()
        if self.precision.compute == torch.bfloat16:
            # Both bf16 modes: float32 sharded parameters (in train.dtype=bfloat16 they are the
            # master weights: 4 + 4 + 8 bytes per parameter, over S) gathered in bf16 to compute.
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=self.reduce_dtype)
        # Under a pipeline schedule the weights stay gathered through the micro-batches by default.
        keep = self.mesh.layout.zero3_keep_gathered or self.mesh.pp > 1
        experts_mesh = self.mesh["edp"] if self.mesh.ep > 1 else None
        for model in chunks:
            for block in model.blocks():
                if experts_mesh is not None and isinstance(block.feed_forward, MoE):
                    # sharded over the ranks that hold the same experts (before the block takes the rest)
                    fully_shard(
                        block.feed_forward.experts, mesh=experts_mesh, mp_policy=mp, reshard_after_forward=not keep
                    )
                fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep)
            # The root (embedding, final norm, head) is used again first in backward: keep it gathered.
            fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
            # Our losses are divided by the global token count already: reduce with a plain SUM.
            # (These setters act on one FSDP module's own parameters, so every module is set.)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
                    # its gathers and reduce-scatters through fived's communication layer
                    # (torch's AllGather / ReduceScatter base classes live in a private module; FSDP2
                    # calls these by that interface)
                    module.set_custom_all_gather(comm.FsdpAllGather())  # type: ignore[arg-type]
                    module.set_custom_reduce_scatter(comm.FsdpReduceScatter())  # type: ignore[arg-type]
        self.chunks = chunks
        self._replicate_group = mesh.get_group(0) if self.mesh.dp_replicate > 1 else None  # (FSDP2's all-reduce's)

    def storage(self, spec: TensorSpec) -> Stored:
        # the storage rules' rows (FSDP2 shards dim 0 in ceil-sized chunks), held to the DTensor's own
        stored = super().storage(spec)
        chunk = dict(self.named_parameters())[spec.name].__create_chunk_list__()[0]
        start = chunk.offsets[0] if len(chunk.offsets) else 0
        rows = (start, start + chunk.sizes[0]) if len(chunk.sizes) else None
        empty = (
            rows is not None and stored.rows is not None and rows[0] == rows[1] and stored.rows[0] == stored.rows[1]
        )  # (no rows: anywhere)
        if rows != stored.rows and not empty:
            raise RuntimeError(f"{spec.name}: FSDP2 stores rows {rows} here, the storage rules say {stored.rows}")
        return stored

    def unrouted_collectives(self):
        """HSDP: FSDP2's all-reduce across replicas has no hook; counted while a step records."""
        if self.mesh.dp_replicate > 1:
            return comm.count_fsdp_replica_all_reduce(self._replicate_group)
        return super().unrouted_collectives()

    def norm_groups(self) -> list:
        return [self.mesh.group("dp_shard_cp")]

    def after_forward_only(self) -> None:
        # Backward is what reshards the root (and blocks kept gathered); an evaluation has none, and
        # a checkpoint or the next step must find every parameter as its rows again.
        from torch.distributed.fsdp import FSDPModule

        for model in self.chunks:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def before_micro_batch(self, is_last: bool) -> None:
        # (Pipeline stages set these themselves per micro-batch; this is the plain loop's.)
        for model in self.chunks:
            sharded = cast("FSDPModule", model)  # (fully_shard made every chunk one)
            sharded.set_requires_gradient_sync(is_last)
            if self.mesh.layout.zero3_keep_gathered:
                sharded.set_reshard_after_backward(is_last)
