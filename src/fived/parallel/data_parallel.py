"""Data parallelism: the interface every ZeRO stage implements (stage 0 in ddp.py, 1-2 in zero.py,
3 in fsdp.py) and the plain single-replica case.

Every strategy sees the same contract from the trainer, for the model chunks this rank holds
(one, or several pipeline stages):
    shard(chunks)             on the meta device, before materialisation (ZeRO-3 shards here)
    wrap(chunks) -> modules   after initialisation (ZeRO-0/1/2 move parameters' gradients into buffers)
    build_optimizer(placements)  AdamW (or Muon and AdamW) over what this rank updates
    before_micro_batch(last)  gradient sync only on the last micro-batch
    reduce_gradients()      after the last micro-batch's backward
    clip_gradients(max)     global norm over every shard; returns it
    step(); zero_grad()

Each rank's loss is already divided by the token count of the *global* batch, so gradients must be
**summed** over ranks (not averaged): the sum is the gradient of the mean loss over all tokens,
whatever the split. Every strategy reduces with SUM for that reason.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from fived.config import Config
from fived.layout.muon_plan import is_muon_tensor
from fived.layout.placement import Placement
from fived.layout.spec import REDUCE_CHUNK_ELEMENTS, DataRank, Stored, TensorSpec, layout_specs
from fived.model.ledger import local_tensor as _local
from fived.model.transformer import Transformer, canonical_name
from fived.optim.adamw import build_optimizer
from fived.parallel import comm
from fived.parallel.expert import is_expert
from fived.parallel.expert_grads import ExpertGradReductions
from fived.parallel.mesh import DTYPES, PRECISIONS, Mesh


class DataParallel:
    """One data-parallel rank (dp = 1), and the base of the other strategies."""

    def __init__(self, mesh: Mesh, cfg: Config, *, specs: dict[str, TensorSpec] | None = None):
        self.mesh, self.cfg = mesh, cfg
        # the sharding spec (`parallelize` computes it once; standalone, from the mesh's layout)
        self.specs = specs if specs is not None else layout_specs(cfg.model, mesh.layout)
        self.chunks: list[Transformer] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.precision = PRECISIONS[cfg.train.dtype]
        # bf16 runs reduce gradients in float32 unless reduce_dtype=bfloat16 (half the bytes sent).
        bf16 = self.precision.compute == torch.bfloat16
        self.reduce_dtype = DTYPES[mesh.layout.reduce_dtype] if bf16 else self.precision.weights
        # (model tensor, its float32 master) for what the optimizer updates in bf16 runs
        self.master_pairs: list[tuple[torch.Tensor, nn.Parameter]] = []
        self.master_of: dict[torch.Tensor, nn.Parameter] = {}
        self.expert_reducing: ExpertGradReductions | None = None  # (overlap_grad_reduce: built at first use)
        self._expert_reducing_built = False

    def shard(self, chunks: list[Transformer]) -> None:
        pass

    def wrap(self, chunks: list[Transformer]) -> list[Transformer]:
        self.chunks = chunks
        return chunks

    def named_parameters(self):
        """(canonical name, parameter) over every chunk this rank holds."""
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                yield canonical_name(name), p

    def build_optimizer(self, placements: dict[str, Placement]) -> torch.optim.Optimizer:
        named = list(self.named_parameters())
        params = self.with_masters(p for _, p in named)
        self.optimizer = self.make_optimizer([(n, p) for (n, _), p in zip(named, params)], placements)
        return self.optimizer

    def make_optimizer(
        self, named: list[tuple[str, torch.Tensor]], placements: dict[str, Placement], decayed=None
    ) -> torch.optim.Optimizer:
        """train.optimizer over `named` [(canonical name, tensor it updates)]: AdamW, or Muon for the
        hidden matrices (orthogonalised whole across the ranks holding their pieces) and AdamW for
        the rest. `decayed(p)`: AdamW's weight decay rule (default: matrices)."""
        t = self.cfg.train
        if t.optimizer != "muon":
            return build_optimizer([p for _, p in named], t, decayed)
        from fived.optim.muon import Muon
        from fived.parallel.muon_exchange import MatrixExchange

        exchange = MatrixExchange(self.mesh, self.cfg, placements)
        specs = self.specs
        matrices = [(n, p) for n, p in named if is_muon_tensor(specs[n]) and p.requires_grad]
        names, plan = {n for n, _ in matrices}, exchange.plan
        stored = {n for n in plan.names if exchange.mine.placements[n].boxes()}  # (ZeRO-1/2: no empty slices)
        if not stored <= names <= set(plan.names):  # (else a matrix outside the plan would go to AdamW)
            raise RuntimeError(
                f"Muon's plan has this rank store pieces of {sorted(stored)} (of {sorted(plan.names)}), "
                f"its optimizer updates {sorted(names)}"
            )
        adamw = build_optimizer([p for n, p in named if n not in names], t, decayed)
        return Muon(matrices, adamw, t, exchange)

    def with_masters(self, tensors) -> list[torch.Tensor]:
        """The tensors the optimizer updates in place of `tensors`: under train.dtype=bfloat16 a
        float32 master copy of each bf16 one (not under ZeRO-3: `fived.layout.layout.masters_apart`)."""
        out = []
        for t in tensors:
            if self.mesh.layout.masters_apart(self.cfg.train.dtype) and t.requires_grad:
                master = nn.Parameter(t.detach().float())
                self.master_pairs.append((t, master))
                self.master_of[t] = master
                t = master
            out.append(t)
        return out

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """The model's bf16 tensors from their masters (after a step, and after a checkpoint loaded
        the masters); the masters' float32 gradients are let go of."""
        for t, master in self.master_pairs:
            t.copy_(master)
            master.grad = None

    def step_masters(self) -> None:
        """AdamW on the masters with the (reduced, clipped) bf16 gradients in float32, then the model's
        bf16 values from them."""
        for t, master in self.master_pairs:
            master.grad = None if t.grad is None else t.grad.float()
        assert self.optimizer is not None  # (built before the first step)
        self.optimizer.step()
        self.masters_to_model()

    def storage(self, spec: TensorSpec) -> Stored:
        """How parameter `spec` is stored here, for its placement (ZeRO-3 rows, or a ZeRO-1/2 flat
        range of the model-local tensor, and the replica index among the data-parallel ranks holding
        the same piece): the storage rules of `fived.layout.spec.DataRank`, which Muon's plan reads
        for every rank. Known on the meta device, right after `shard`."""
        return self.data_rank().stored(spec)

    def data_rank(self) -> DataRank:
        """This rank's place in data parallelism, from its mesh."""
        m, L = self.mesh, self.mesh.layout
        many = L.dp_cp > 1
        return DataRank(
            L.zero,
            L.pp,
            L.ep,
            L.dp_cp,
            L.shards,
            m.rank("dp_shard_cp") if many else 0,
            m.rank("dp_replicate") if m.dp_replicate > 1 else 0,
            m.rank("dp_cp") if many else 0,
            L.edp,
            m.layout.expert_index(m.rank("dp_cp") if many else 0, m.rank("tp") if m.tp > 1 else 0),
        )

    def optimized(self):
        """(canonical name, the tensor the optimizer updates for it here): the parameter itself, its
        ZeRO-1/2 slice, or its ZeRO-3 DTensor; in bf16 runs their float32 master. Checkpoints read
        both values and moments from it."""
        for name, p in self.named_parameters():
            yield name, self.master_of.get(p, p)

    def before_micro_batch(self, is_last: bool) -> None:
        """(Strategies overriding it call it: it arms the experts' overlapped reduction.)"""
        reducing = self.expert_reductions()
        if reducing is not None and self.mesh.pp == 1:  # (a pipeline says which backward is last)
            reducing.arm(is_last)

    def unrouted_collectives(self):
        """A context counting collectives of a library this strategy uses that cannot be routed
        through `fived.parallel.comm` (none here; FSDP2's HSDP all-reduce under ZeRO-3)."""
        return contextlib.nullcontext()

    def after_forward_only(self) -> None:
        """After an evaluation (forward passes, no backward): storage back as a training step leaves it."""

    def backward_of_stage(self, *, last: bool, weights: bool, stage: nn.Module | None = None) -> None:
        """A pipeline stage's backward starts (`stage` None) or ends (ZeRO-1/2 with overlap_grad_reduce
        start reducing a stage's buckets after its last one; with overlap_grad_reduce the experts'
        edp reduction too: strategies overriding it call it)."""
        if self.expert_reducing is not None:
            self.expert_reducing.backward_of_stage(last=last, weights=weights, stage=stage)

    def wait_parameters(self) -> None:
        """Wait for parameter all-gathers still in flight (ZeRO-1/2 with overlap_param_gather): before
        anything but the next forward reads the parameters (a checkpoint, an evaluation, the result)."""

    def finish_backward(self) -> None:
        """Wait for reductions the backward pass started (ZeRO-0 overlaps them with backward)."""

    def reduce_gradients(self) -> None:
        pass

    # Experts under expert parallelism (outside ZeRO-3, which shards them over edp itself) are kept
    # apart: their gradients are summed over edp only, and their norm over ep.
    experts_apart = True

    def expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        if self.mesh.ep == 1 or not self.experts_apart:
            return []
        return [(n, p) for n, p in self.named_parameters() if is_expert(n)]

    def expert_reductions(self) -> ExpertGradReductions | None:
        """The experts' edp reduction during backward (parallel.overlap_grad_reduce, edp > 1), built
        before the first backward: its hooks go on the parameters as the run trains them."""
        if not self._expert_reducing_built:
            self._expert_reducing_built = True
            experts = self.expert_parameters()
            if self.mesh.layout.overlap_grad_reduce and self.mesh.edp > 1 and experts:
                self.expert_reducing = ExpertGradReductions(experts, self.mesh.group("edp"), self.reduce_dtype)
        return self.expert_reducing

    def reduce_expert_gradients(self) -> None:
        if self.expert_reducing is not None:  # (started during backward: the rest now, then the waits)
            self.expert_reducing.finish()
        elif self.mesh.edp > 1:
            _all_reduce_flat(
                [p.grad for _, p in self.expert_parameters() if p.grad is not None],
                self.mesh.group("edp"),
                self.reduce_dtype,
            )

    def named_grads(self, model_grads: bool = False):
        """(canonical parameter name, local gradient) for what the optimizer steps; model_grads=True:
        the model's own gradients (before the dp reduction of ZeRO-1/2)."""
        apart = {n for n, _ in self.expert_parameters()}
        for name, p in self.named_parameters():
            if p.grad is not None and (model_grads or name not in apart):
                yield name, _local(p.grad)

    def norm_groups(self) -> list:
        """Groups over which the local gradients of named_grads are disjoint pieces."""
        return []

    @torch.no_grad()
    def clip_gradients(self, max_norm: float, weight=lambda name: 1.0, extra_groups=()) -> float:
        """Global L2 norm over every piece of every gradient, then clip (as torch's clip_grad_norm_:
        coefficient max_norm / (norm + 1e-6), at most 1). `weight(name)` counts pieces that other
        ranks also hold (tensor-parallel replicas) once. The norm's all-reduces, over whatever group,
        are timed as the gradient reductions' ("dp", role), as the planner prices them."""
        grads = list(self.named_grads())
        sq = torch.zeros((), dtype=torch.float64, device=grads[0][1].device)
        for name, g in grads:
            sq += weight(name) * g.double().square().sum()
        experts = [(n, p.grad) for n, p in self.expert_parameters() if p.grad is not None]
        if experts:  # disjoint over ep, equal over edp: summed over ep, then counted once below
            expert_sq = sum(weight(n) * g.double().square().sum() for n, g in experts)
            comm.all_reduce(expert_sq, self.mesh.group("ep"), role="dp")
            # (folded, parallel.etp=1: ep spans tp ranks too, which the sum over tp below repeats)
            repeated = self.norm_groups() + ([self.mesh.group("tp")] if self.mesh.layout.folded else [])
            for group in repeated:
                expert_sq = expert_sq / dist.get_world_size(group)
            sq += expert_sq
            grads += experts
        for group in self.norm_groups() + list(extra_groups):
            comm.all_reduce(sq, group, role="dp")
        norm = sq.sqrt().item()
        if max_norm > 0:
            coef = min(max_norm / (norm + 1e-6), 1.0)
            if coef < 1.0:
                for _, g in grads:
                    g.mul_(coef)
        return norm

    def step(self) -> None:
        self.step_masters()

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        for t, _ in self.master_pairs:
            t.grad = None

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds for the model state, for the memory ledger."""
        params = [p for _, p in self.named_parameters()]
        return {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "optimizer": self.optimizer_state(),
        }

    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat buffers this strategy allocated (padding included): the parameters and gradients
        above live in them, so they are the same bytes, not more (`fived dryrun` lists them)."""
        return []

    def optimizer_state(self) -> list[torch.Tensor]:
        """Adam's tensors (not the scalar step counters) and the float32 masters of bf16 runs."""
        assert self.optimizer is not None
        return [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0] + [
            master for _, master in self.master_pairs
        ]


def _all_reduce_flat(grads: list[torch.Tensor], group, reduce_dtype: torch.dtype) -> None:
    """Sum `grads` over `group`: their elements packed into flat buffers of at most
    REDUCE_CHUNK_ELEMENTS (a gradient may span two), each cast to `reduce_dtype` and all-reduced —
    one buffer for small models; for big ones the cast copy stays a bounded transient (the planner's)."""
    views = [g.view(-1) for g in grads]  # (views: a gradient is contiguous, like its parameter)
    batch, room = [], REDUCE_CHUNK_ELEMENTS
    for view in views:
        start = 0
        while start < view.numel():
            take = min(room, view.numel() - start)
            batch.append(view[start : start + take])
            start, room = start + take, room - take
            if room == 0:
                _all_reduce_pieces(batch, group, reduce_dtype)
                batch, room = [], REDUCE_CHUNK_ELEMENTS
    if batch:
        _all_reduce_pieces(batch, group, reduce_dtype)


def _all_reduce_pieces(pieces: list[torch.Tensor], group, reduce_dtype: torch.dtype) -> None:
    flat = torch.cat(pieces).to(reduce_dtype)
    comm.all_reduce(flat, group, role="dp")
    offset = 0
    for piece in pieces:  # (views of the gradients: written in place)
        piece.copy_(flat[offset : offset + piece.numel()])
        offset += piece.numel()
