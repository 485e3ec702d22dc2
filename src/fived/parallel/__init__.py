"""The parallelism recipe: `parallelize(model, mesh, cfg)` applies, in order,
TP -> CP -> EP -> pipeline split -> activation checkpointing -> data parallelism (ZeRO / FSDP),
each a short function in a file of its own. The model code itself has no parallel branches.

It runs on the meta device, before any parameter is materialised, and returns the `ParallelPlan`
the trainer drives: initialise shards, loss, gradient finishing, clipping, whole parameters.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from fived.config import Config
from fived.mesh import Mesh
from fived.model import Transformer
from fived.parallel.checkpointing import apply_activation_checkpointing
from fived.parallel.context import apply_context_parallel
from fived.parallel.data_parallel import DataParallel, make_data_parallel
from fived.parallel.expert import apply_expert_parallel
from fived.parallel.tensor import TensorParallel


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies, computed in at least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


@dataclass
class ParallelPlan:
    data_parallel: DataParallel
    tensor_parallel: TensorParallel | None = None
    pp_group: object = None  # the pipeline group, when the model is split into stages
    positions: torch.Tensor | None = None  # this rank's token positions under context parallelism
    expert_shards: dict = field(default_factory=dict)  # expert parameter -> (dim, pieces, index)
    ep_group: object = None

    def local_init(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a parameter's full initial value (before any ZeRO sharding)."""
        if name in self.expert_shards:
            dim, pieces, index = self.expert_shards[name]
            full = full.chunk(pieces, dim=dim)[index].contiguous()
        spec = self.tensor_parallel.shards.get(name) if self.tensor_parallel else None
        return spec.local(full) if spec else full

    def forward_context(self, activations=None):
        """Saved-tensor hooks for a forward pass: sequence-parallel shards stored instead of gathered
        inputs, and the activation ledger's count of what is saved (when it records)."""
        tp = self.tensor_parallel if self.tensor_parallel is not None and self.tensor_parallel.sp else None
        if tp is None and (activations is None or not activations.recording):
            return contextlib.nullcontext()

        def pack(t):
            packed = tp.pack(t) if tp is not None else t
            if activations is not None:
                activations.note(packed[1]["shard"] if isinstance(packed, tuple) else packed)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, tp.unpack if tp is not None else (lambda p: p))

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.tensor_parallel.loss_sum(logits, targets) if self.tensor_parallel else lm_loss_sum(logits, targets)

    def finish_gradients(self) -> None:
        """After the last micro-batch's backward: tensor-parallel partial sums, then the dp reduction."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.finish_gradients(self.data_parallel.named_grads(model_grads=True))
        self.data_parallel.reduce_gradients()

    def clip_gradients(self, max_norm: float) -> float:
        tp = self.tensor_parallel
        groups = [self.pp_group] if self.pp_group is not None else []  # stages hold disjoint parameters
        if tp is None:
            return self.data_parallel.clip_gradients(max_norm, extra_groups=groups)
        return self.data_parallel.clip_gradients(max_norm, weight=tp.norm_weight, extra_groups=groups + [tp.group])

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on CPU, by canonical name (gathers ZeRO-3 and tensor-parallel shards)."""
        out = {}
        for name, p in self.data_parallel.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if self.tensor_parallel is not None:
                full = self.tensor_parallel.gather_full(name, full)
            if name in self.expert_shards:
                pieces = self.expert_shards[name][1]
                parts = full.new_empty((pieces * full.shape[0],) + tuple(full.shape[1:]))
                torch.distributed.all_gather_single(parts, full.contiguous(), group=self.ep_group)
                full = parts
            out[name] = full.detach().cpu().clone()
        if self.pp_group is not None:  # every stage's parameters, on every rank
            parts = [None] * torch.distributed.get_world_size(self.pp_group)
            torch.distributed.all_gather_object(parts, out, group=self.pp_group)
            out = {k: v for part in parts for k, v in part.items()}
        return out


def parallelize(chunks: list[Transformer], mesh: Mesh, cfg: Config) -> ParallelPlan:
    """`chunks`: the whole model, or this rank's pipeline stages (already split, on meta)."""
    tensor_parallel = apply_tensor_parallel(chunks, mesh, cfg)
    positions = None
    if mesh.cp > 1:
        positions = apply_context_parallel(chunks, mesh.group("cp"), mesh.cp, mesh.rank("cp"), cfg.train.seq_len)
    expert_shards = {}
    if mesh.ep > 1:
        expert_shards = apply_expert_parallel(chunks, mesh.group("ep"), mesh.ep, mesh.rank("ep"))
    for chunk in chunks:
        apply_activation_checkpointing(chunk, cfg.train.activation_checkpointing)
    data_parallel = make_data_parallel(mesh, cfg)
    data_parallel.shard(chunks)
    return ParallelPlan(data_parallel, tensor_parallel, mesh.group("pp") if mesh.pp > 1 else None, positions,
                        expert_shards, mesh.group("ep") if mesh.ep > 1 else None)


def apply_tensor_parallel(chunks: list[Transformer], mesh: Mesh, cfg: Config) -> TensorParallel | None:
    if mesh.tp == 1:
        return None
    tp = TensorParallel(chunks[0], mesh.group("tp"), cfg.parallel.sp, mesh.tp, mesh.rank("tp"))
    for chunk in chunks:
        tp.apply(chunk)
    return tp
