"""Tensor parallelism (Megatron-style) with optional sequence parallelism, applied from outside.

Parameters are sharded in place on the meta device (names unchanged), and each attention / MLP
block becomes a tensor-parallel *region* through forward hooks:

    enter: without SP copy_to_tp (identity; all-reduce of the input gradient in backward)
           with SP    gather_from_sp (all-gather along the sequence; reduce-scatter in backward)
    inside: column-parallel q/k/v and gate/up (output features split), row-parallel o and down
    exit:  without SP reduce_from_tp (all-reduce; identity in backward)
           with SP    reduce_scatter_to_sp (reduce-scatter along the sequence; all-gather in backward)

With SP the gathered input of a region is not kept for backward: a saved-tensor hook stores this
rank's sequence shard and gathers it again when backward needs it (as Megatron-LM does), so
activation memory really shrinks by tp; the price is one more all-gather per region in backward.

MoE parallel folding (parallel.etp=1, needs SP): the MoE block is no region. Its input stays this
rank's sequence shard, which it routes itself to whole experts over the folded ep group
(`fived.parallel.expert`); only its shared experts (dense, tp-split) are a region of their own. The
router's gradient is then a partial sum over tp like the norms', and the per-sequence balancing
statistics are summed over tp, so the auxiliary loss is the one-device value on every tp rank.

The embedding is vocab-parallel and the output head column-parallel over the vocabulary; the loss is
a vocab-parallel cross-entropy that never gathers the logits. A vocabulary that does not divide by
tp is padded; padded logits are masked out, so the loss is exactly the one-device loss.
Grouped-query attention with fewer kv heads than tp replicates kv heads: rank r holds kv head
r // (tp / n_kv_heads), and the ranks sharing a head sum its gradient.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from fived.layout.spec import Cut, TensorSpec
from fived.model.transformer import MoE, Transformer, canonical_name
from fived.parallel import comm
from fived.parallel.tensor_overlap import current_backward_pass, install_overlapped_region

# --- the communication of a tensor-parallel region, as autograd functions -------------------------


class CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, ctx.group)
        return grad, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # A copy: the input may be kept elsewhere (selective checkpointing saves matmul outputs
        # and would reduce them a second time on recompute if reduced in place).
        x = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s/tp, ...] on each rank -> [b, s, ...] (dim 1 is the sequence)."""
    world = dist.get_world_size(group)
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((world * xt.shape[0],) + xt.shape[1:], dtype=x.dtype, device=x.device)
    comm.all_gather_single(out, xt, group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, s, ...] partial sums -> [b, s/tp, ...] reduced sums of this rank's sequence chunk."""
    world = dist.get_world_size(group)
    xt = x.transpose(0, 1).contiguous()
    out = torch.empty((xt.shape[0] // world,) + xt.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_single(out, xt, group)
    return out.transpose(0, 1).contiguous()  # contiguous: it may be sent to the next pipeline stage


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


# --- the plan -------------------------------------------------------------------------------------


class TensorParallel:
    """The tensor-parallel plan of one model: each parameter split as the sharding spec says
    (`fived.layout.spec`: heads, feed-forward and expert hidden sizes, the padded vocabulary, kv
    heads several ranks hold), the gradients that are partial sums over tp, and the region hooks."""

    def __init__(
        self,
        model: Transformer,
        group,
        sequence_parallel: bool,
        size: int,
        rank: int,
        specs: dict[str, TensorSpec],
        *,
        overlap: bool = False,
        fold_experts: bool = False,
    ):
        """`size`/`rank` are given, not read from `group`, so a plan can be made without processes.
        `overlap`: attention and dense MLP regions overlap their communication with their GEMMs
        (`fived.parallel.tensor_overlap`); MoE regions keep the hooks below. `fold_experts`
        (parallel.etp=1): MoE blocks route their own sequence shard (see the module's text)."""
        self.group, self.sp = group, sequence_parallel
        self.overlap, self.fold_experts = overlap, fold_experts
        self.tp, self.rank = size, rank
        self.cfg = model.cfg
        self.specs = specs
        self.shards: dict[str, Cut] = {}  # the parameters this plan cut, and how
        self.vocab = model.cfg.vocab_size
        self._regather: dict = {}  # storage of a gathered region input -> (sequence shard, weakref)

    # parameters ----------------------------------------------------------------------------------
    def apply(self, model: Transformer) -> None:
        """Cut this chunk's parameters (on meta), then make every attention and MLP block a region."""
        for name, module, attr in _parameter_slots(model):
            spec = self.specs.get(name)
            if spec is None:  # (a tied head: the embedding, re-tied below)
                continue
            if spec.tp is not None:
                self._split(module, attr, name, spec.tp)
        for block in model.blocks():
            self._region(block.attention)
            moe = block.feed_forward
            if isinstance(moe, MoE) and self.fold_experts:
                self._fold(moe)
                continue
            self._region(moe)
            if isinstance(moe, MoE):
                # the auxiliary loss, computed identically on each rank, is seeded 1/tp per rank
                moe.aux_loss_scale /= self.tp
        self._vocab_parallel(model)
        if model.mtp is not None:
            model.mtp.loss_sum = self.loss_sum
        if self.sp:
            model.sequence_shards = self.tp  # hidden states between pipeline stages are shards

    def _fold(self, moe: MoE) -> None:
        """A folded MoE: no region around it; its shared experts one (gathered, tp-split, reduce-
        scattered back to the shard). Each rank's router sees only its tokens, so the per-sequence
        statistics are summed over tp in forward (identity backward: each rank's seed of the whole
        loss reaches its own tokens' probabilities; the aux scale is not divided by tp)."""
        assert self.sp  # (the layout rules refuse folding without sequence parallelism)
        if moe.shared is not None:
            self._region(moe.shared)
        previous = moe.reduce_sequence_stats
        moe.reduce_sequence_stats = lambda t: ReduceFromTensorParallelRegion.apply(previous(t), self.group)

    def _split(self, module: nn.Module, attr: str, name: str, cut: Cut) -> None:
        param = getattr(module, attr)
        shape = list(param.shape)
        shape[cut.dim] = cut.size(shape[cut.dim])
        setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device)))
        self.shards[name] = cut

    def _vocab_parallel(self, model: Transformer) -> None:
        """Hooks of the vocab-parallel embedding and head (a pipeline stage may have one, or neither)."""
        if model.tok_embeddings is not None:
            self.hook_embedding(model.tok_embeddings)
        if model.output is None:
            return
        if model.cfg.tie_embeddings and model.tok_embeddings is not None:
            model.output.weight = model.tok_embeddings.weight
        model.output.register_forward_pre_hook(lambda m, args: (self._enter(args[0]),))

    def hook_embedding(self, embedding: nn.Module) -> None:
        """Make `embedding` (this rank's rows of the vocabulary) vocab-parallel: the embedding, or the
        last stage's copy of it (fived.parallel.mtp_embedding)."""
        lo = self.specs["tok_embeddings.weight"].local_box(tp_rank=self.rank)[0][0]  # this rank's first row
        embedding.register_forward_hook(self._embedding_hook(lo), with_kwargs=False)
        embedding.register_forward_pre_hook(self._embedding_pre_hook(lo))

    # forward -------------------------------------------------------------------------------------
    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sp:
            return CopyToTensorParallelRegion.apply(x, self.group)
        full = GatherFromSequenceParallelRegion.apply(x, self.group)
        # Regions run one after another: the previous region's saved tensors are packed already.
        self._regather.clear()
        # Weakly: the gathered input must be freed as soon as the region's ops are done with it.
        self._regather[full.untyped_storage().data_ptr()] = {
            "shard": x.detach(),
            "gathered": weakref.ref(full),
            "uses": 0,
            "full": None,
        }
        return full

    def _exit(self, y: torch.Tensor) -> torch.Tensor:
        if self.sp:
            return ReduceScatterToSequenceParallelRegion.apply(y, self.group)
        return ReduceFromTensorParallelRegion.apply(y, self.group)

    def _region(self, module: nn.Module) -> None:
        if self.overlap and install_overlapped_region(module, self.group, sequence_parallel=self.sp):
            return
        module.register_forward_pre_hook(lambda m, args: (self._enter(args[0]),) + tuple(args[1:]))
        module.register_forward_hook(lambda m, args, out: self._exit(out))

    def _embedding_pre_hook(self, lo: int):
        def pre(module, args):
            tokens = args[0]
            self._outside = (tokens < lo) | (tokens >= lo + module.weight.shape[0])
            return ((tokens - lo).masked_fill(self._outside, 0),)

        return pre

    def _embedding_hook(self, lo: int):
        def post(module, args, out):
            out = out.masked_fill(self._outside[..., None], 0.0)  # rows owned by another rank
            return self._exit(out)

        return post

    # saved tensors: with SP keep the sequence shard of a gathered input, gather again in backward --
    def pack(self, t: torch.Tensor):
        """Saved-tensor pack hook: a view of a gathered region input is stored as this rank's shard.
        All views of one gathered input share a holder, so backward gathers it once and drops it
        after its last use."""
        ptr = t.untyped_storage().data_ptr()
        holder = self._regather.get(ptr)
        full = holder["gathered"]() if holder is not None else None
        if holder is None or full is None or full.untyped_storage().data_ptr() != ptr:
            return t
        holder["uses"] += 1
        return ("sp-shard", holder, t.shape, t.stride(), t.storage_offset())

    def unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        _, holder, shape, stride, offset = packed
        if holder["full"] is None:
            holder["full"] = _gather_seq(holder["shard"], self.group)
        full = holder["full"]
        if current_backward_pass() != "input":  # (a split backward's weight pass unpacks each view again)
            holder["uses"] -= 1
            if holder["uses"] == 0:
                holder["full"] = None
        return full.as_strided(shape, stride, offset)

    # loss ----------------------------------------------------------------------------------------
    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Vocab-parallel cross-entropy, summed over tokens (those `valid` marks, if given); logits are
        this rank's vocab slice."""
        each = self.token_losses(logits, targets)
        return (each if valid is None else each * valid.to(each.dtype)).sum()

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel cross-entropy of each token (targets' shape), the same on every tp rank."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        width = logits.shape[-1]
        lo = self.rank * width
        if lo + width > self.vocab:  # padded columns: not part of the vocabulary
            col = torch.arange(lo, lo + width, device=logits.device)
            logits = logits.masked_fill(col >= self.vocab, float("-inf"))
        top = logits.detach().amax(dim=-1)
        comm.all_reduce(top, self.group, op=dist.ReduceOp.MAX)
        shifted = logits - top[..., None]
        sum_exp = ReduceFromTensorParallelRegion.apply(shifted.exp().sum(dim=-1), self.group)
        mine = (targets >= lo) & (targets < lo + width)
        local_t = (targets - lo).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_t[..., None]).squeeze(-1).masked_fill(~mine, 0.0)
        target_logit = ReduceFromTensorParallelRegion.apply(picked, self.group)
        return sum_exp.log() - target_logit

    # gradients, norms, whole parameters ----------------------------------------------------------
    def finish_gradients(self, named_grads) -> None:
        """Sum partial gradients over tp: replicated parameters that saw different data (norms under
        SP, the MoE router) and kv heads that several ranks hold. Their time is the gradient
        reductions' ("dp", role): after backward, once a step, as the planner prices them."""
        for name, grad in named_grads:
            spec = self.specs.get(name)
            if spec is None or not spec.tp_summed:  # (the sharding spec says which, and how many elements)
                continue
            if spec.tp_partial_grad:
                comm.all_reduce(grad, self.group, role="dp")
                continue
            cut = self.shards[name]  # (kv heads several tp ranks hold: each holder's slot)
            slots = grad.new_zeros((cut.pieces,) + tuple(grad.shape))
            slots[cut.index(self.rank)] = grad
            comm.all_reduce(slots, self.group, role="dp")
            grad.copy_(slots[cut.index(self.rank)])

    def norm_weight(self, name: str) -> float:
        """Weight of this rank's squared gradient norm when summed over tp: 1 for a split parameter,
        1/tp for a replicated one (counted once), 1/replicas for shared kv heads."""
        spec = self.shards.get(name)
        if spec is None:  # (folded experts are distinct pieces over ep x edp, which span tp)
            return 1.0 if name in self.specs and self.specs[name].folded else 1.0 / self.tp
        return 1.0 / spec.replicas


def _parameter_slots(model: nn.Module):
    """(canonical name, owning module, attribute) of every parameter slot; a parameter two modules
    share (a tied head) appears under each name."""
    for prefix, module in model.named_modules():
        for attr in list(module._parameters):
            yield canonical_name(f"{prefix}.{attr}" if prefix else attr), module, attr
