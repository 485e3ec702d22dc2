"""The parallelism recipe: `parallelize(model, mesh, cfg)` applies, in order,
TP -> CP -> EP -> pipeline split -> FP8 linears -> activation checkpointing -> data parallelism
(ZeRO / FSDP), each a short function in a file of its own. The model code itself has no parallel branches.

It runs on the meta device, before any parameter is materialised, and returns the `ParallelPlan`
the trainer drives: initialise shards, loss, gradient finishing, clipping, whole parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fived.config import Config
from fived.layout.placement import Box, Placement
from fived.layout.spec import TensorSpec, layout_specs
from fived.model.ledger import local_tensor
from fived.model.transformer import Transformer, canonical_name
from fived.parallel.checkpointing import apply_activation_checkpointing
from fived.parallel.compile import apply_compile
from fived.parallel.context import apply_context_parallel
from fived.parallel.data_parallel import DataParallel
from fived.parallel.ddp import ReplicatedDataParallel
from fived.parallel.expert import apply_expert_parallel
from fived.parallel.fp8 import apply_fp8
from fived.parallel.fsdp import FullyShardedDataParallel
from fived.parallel.mesh import Mesh
from fived.parallel.tensor import TensorParallel
from fived.parallel.zero import ShardedOptimizerDataParallel

if TYPE_CHECKING:
    from fived.parallel.mtp_embedding import MTPEmbeddingLink


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
    # canonical name -> where this rank's piece of the parameter (or buffer) sits in the whole
    placements: dict[str, Placement] = field(default_factory=dict)
    global_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # every parameter, whole
    mtp_link: MTPEmbeddingLink | None = None  # the last stage's copy of the embedding (fived.parallel.mtp_embedding)

    def init_placement(self, name: str) -> Placement:
        """Where this rank's parameter storage sits when it is initialised: its ZeRO-3 rows, or the
        whole model-local tensor (a ZeRO-1/2 parameter is whole until `wrap`; `flat` is its
        optimizer's slice)."""
        return dataclasses.replace(self.placements[name], flat=None)

    def forward_context(self, activations=None):
        """Saved-tensor hooks for a forward pass: sequence-parallel shards stored instead of gathered
        inputs, and the activation ledger's count of what is saved (when it records)."""
        tp = self.tensor_parallel if self.tensor_parallel is not None and self.tensor_parallel.sp else None
        if tp is None and (activations is None or not activations.recording):
            return contextlib.nullcontext()

        @torch.compiler.disable  # bookkeeping run by autograd as it saves; never traced into a block's graph
        def pack(t):
            packed = tp.pack(t) if tp is not None else t
            if activations is not None:
                activations.note(packed[1]["shard"] if isinstance(packed, tuple) else packed)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, tp.unpack if tp is not None else (lambda p: p))

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.tensor_parallel.loss_sum(logits, targets) if self.tensor_parallel else lm_loss_sum(logits, targets)

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each token's cross-entropy (targets' shape): per-row sums for a blend's per-source losses."""
        if self.tensor_parallel:
            return self.tensor_parallel.token_losses(logits, targets)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        flat = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return flat.view_as(targets)

    def finish_gradients(self) -> None:
        """After the last micro-batch's backward: tensor-parallel partial sums, then the dp reduction
        (the part of it that overlapped backward completes first: both act on the same gradients)."""
        self.data_parallel.finish_backward()
        if self.mtp_link is not None:  # (before the dp reduction: the first stage's gradient is still whole)
            self.mtp_link.add_gradient()
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
        """Every parameter whole, on CPU, by canonical name, on every rank: each rank writes the pieces
        it saves (replica 0) into zeros and one sum over all ranks assembles them. (For verification
        and small models: it holds the whole model. A placement table with a gap or an overlap shows
        up here as wrong values.) All parameters travel in one flat sum: one collective instead of one
        per tensor (each element has one writer, so the sum is exact in any order)."""
        stored = dict(self.data_parallel.optimized())
        like = next(iter(stored.values()))
        sizes = [math.prod(shape) for shape in self.global_shapes.values()]
        flat = torch.zeros(sum(sizes), dtype=like.dtype, device=like.device)
        wholes = {
            name: piece.view(shape) for (name, shape), piece in zip(self.global_shapes.items(), flat.split(sizes))
        }
        for name, full in wholes.items():
            placement, value = self.placements.get(name), stored.get(name)
            if value is not None and placement is not None and placement.replica == 0:
                for box, view in placement.pieces(local_tensor(value.detach())):
                    full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))] = view
        torch.distributed.all_reduce(flat)
        return {name: full.to("cpu", copy=True) for name, full in wholes.items()}  # (each its own storage)


def parallelize(chunks: list[Transformer], mesh: Mesh, cfg: Config) -> ParallelPlan:
    """`chunks`: the whole model, or this rank's pipeline stages (already split, on meta)."""
    layout = mesh.layout  # (the runtime's one layout input; cfg for the model and training)
    specs = layout_specs(cfg.model, layout)  # (once: the strategies and the placements read these)
    tensor_parallel = apply_tensor_parallel(chunks, mesh, cfg, specs)
    positions = None
    if mesh.cp > 1:
        positions = apply_context_parallel(chunks, mesh, cfg)
    if mesh.ep > 1:
        apply_expert_parallel(chunks, mesh.group("ep"), mesh.ep, overlap=layout.ep_overlap)
    # after the tp cut (Float8Linear adopts the cut weight) and before ZeRO/FSDP take the parameters
    apply_fp8(chunks, cfg.train.fp8, device_type=mesh.device_type)
    for chunk in chunks:
        apply_activation_checkpointing(chunk, cfg.train.activation_checkpointing)
        if cfg.train.compile:
            apply_compile(chunk, cfg.train.compile_backend)
    data_parallel = make_data_parallel(mesh, cfg, specs=specs)
    data_parallel.shard(chunks)
    tp_rank = mesh.rank("tp") if mesh.tp > 1 else 0
    ep_rank = mesh.rank("ep") if mesh.ep > 1 else 0
    placements = describe_placements(chunks, specs, data_parallel, tp=mesh.tp, tp_rank=tp_rank, ep_rank=ep_rank)
    global_shapes = {name: s.shape for name, s in specs.items() if not s.buffer}
    return ParallelPlan(
        data_parallel, tensor_parallel, mesh.group("pp") if mesh.pp > 1 else None, positions, placements, global_shapes
    )


def describe_placements(
    chunks, specs: dict[str, TensorSpec], data_parallel: DataParallel, *, tp: int, tp_rank: int, ep_rank: int
) -> dict[str, Placement]:
    """The placement of every parameter and buffer this rank holds (see fived.layout.placement): its tp/ep
    box from the sharding spec, its data-parallel storage from the ZeRO stage's own layout."""
    out = {}
    for chunk in chunks:
        for raw, param in chunk.named_parameters():
            spec = specs[canonical_name(raw)]
            box = Box(*spec.local_box(tp_rank=tp_rank, ep_rank=ep_rank))
            if tuple(param.shape) != box.sizes:  # (a ZeRO-3 DTensor's shape is the unsharded local one)
                raise RuntimeError(f"{spec.name}: the runtime built {tuple(param.shape)}, the spec says {box.sizes}")
            stored = data_parallel.storage(spec)
            out[spec.name] = Placement(
                spec.shape, box, spec.tp_replica(tp_rank) + tp * stored.replica, stored.rows, stored.flat
            )
        for raw, _ in chunk.named_buffers():
            spec = specs[canonical_name(raw)]
            whole = Box((0,) * len(spec.shape), spec.shape)
            out[spec.name] = Placement(spec.shape, whole, tp_rank + tp * data_parallel.data_rank().whole_replica(spec))
    return out


def make_data_parallel(mesh: Mesh, cfg: Config, *, specs: dict[str, TensorSpec] | None = None) -> DataParallel:
    """The strategy of the ZeRO stage (here, not in data_parallel.py: the stages build on its base)."""
    layout = mesh.layout
    if layout.zero == 3:
        return FullyShardedDataParallel(mesh, cfg, specs=specs)
    # ZeRO-1/2, and ZeRO-0 under a pipeline schedule (one all-reduce of a flat buffer per step,
    # after the schedule, instead of DDP hooks inside it)
    if layout.flat_buffer:
        return ShardedOptimizerDataParallel(mesh, cfg, specs=specs)
    return (DataParallel if layout.dp_cp == 1 else ReplicatedDataParallel)(mesh, cfg, specs=specs)


def apply_tensor_parallel(
    chunks: list[Transformer], mesh: Mesh, cfg: Config, specs: dict[str, TensorSpec]
) -> TensorParallel | None:
    if mesh.tp == 1:
        return None
    tp = TensorParallel(
        chunks[0],
        mesh.group("tp"),
        mesh.layout.sp,
        mesh.tp,
        mesh.rank("tp"),
        specs,
        overlap=mesh.layout.tp_overlap,
        fold_experts=mesh.layout.folded,
    )
    for chunk in chunks:
        tp.apply(chunk)
    return tp
