"""Expert parallelism: the routed experts of every MoE layer sharded over `ep` ranks (ep divides
dp*cp); tokens travel to their experts' ranks and back with all-to-all (uneven splits).

The ranks of one dp*cp group are cut into ep groups of consecutive ranks (ep innermost) and
expert-data-parallel (edp) groups across them. Rank j of an ep group holds experts
[j*E/ep, (j+1)*E/ep). Routing, the shared experts and the load-balancing statistics stay local and
dense, so the auxiliary loss does not depend on the layout; dropless by default.

Gradients: an expert's gradient already sums the tokens of every rank of its ep group (the
all-to-all carries them back), so it is reduced only over edp; dense gradients over all of dp*cp.
"""

from __future__ import annotations

import torch

from fived.layout.layout import EP_OVERLAP_CHUNKS
from fived.model.transformer import GroupedExperts, MoE, Transformer
from fived.parallel import comm
from fived.parallel.expert_overlap import overlapped_experts


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), group, output_splits=out_splits, input_splits=in_splits, role="ep")
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(
            back, grad.contiguous(), ctx.group, output_splits=in_splits, input_splits=out_splits, role="ep"
        )
        return back, None, None, None


class ExpertParallelExperts(GroupedExperts):
    """This rank's experts (same parameter names as GroupedExperts), fed through all-to-all;
    `overlap_chunks` > 1: in that many chunks, each one's exchanges under another's GEMMs
    (`fived.parallel.expert_overlap`)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, group, ep: int, *, overlap_chunks: int = 1, clamped=None):
        super().__init__(n_experts // ep, dim, hidden, clamped=clamped)
        self.group, self.ep, self.n_experts = group, ep, n_experts
        self.overlap_chunks = overlap_chunks

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: this rank's routing slots sorted by (global) expert; counts: slots per global expert.
        (The all-to-all's split sizes are host integers: one read of the counts per layer.)"""
        local = self.n_experts // self.ep
        send_counts = counts.to(torch.int64)
        recv_counts = torch.empty_like(send_counts)  # [source rank, local expert], flattened
        comm.all_to_all_single(recv_counts, send_counts, self.group, role="ep")
        if self.overlap_chunks > 1:
            return overlapped_experts(
                x,
                send_counts.view(self.ep, local),
                recv_counts.view(self.ep, local),
                self.group,
                self.by_source,
                chunks=self.overlap_chunks,
            )
        send_splits = send_counts.view(self.ep, local).sum(1).tolist()
        recv = recv_counts.view(self.ep, local)
        tokens = AllToAll.apply(x, recv.sum(1).tolist(), send_splits, self.group)
        return AllToAll.apply(self.by_source(tokens, recv), send_splits, recv.sum(1).tolist(), self.group)

    def by_source(self, tokens: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
        """The local experts over received rows, grouped by source rank then local expert (recv
        [ep, local] rows each), in that order: regrouped by expert for the GEMMs and back."""
        local = self.n_experts // self.ep
        by_source = torch.split(torch.arange(tokens.shape[0], device=tokens.device), recv.flatten().tolist())
        order = torch.cat([by_source[r * local + e] for e in range(local) for r in range(self.ep)])
        out = super().forward(tokens[order], recv.sum(0))  # bf16 under autocast
        y = torch.empty_like(out)
        y[order] = out
        return y


def apply_expert_parallel(chunks: list[Transformer], group, ep: int, *, overlap: bool = False) -> None:
    """Swap each MoE's experts for this rank's share (on the meta device): E/ep consecutive experts,
    ep rank j holding [j*E/ep, (j+1)*E/ep) as the sharding spec places them (`fived.layout.spec`, dim
    0 of each expert tensor); the dispatch's split sizes follow that order, and the placements check
    every local shape against the spec. `overlap` (parallel.ep_overlap): the exchanges in chunks
    under the expert GEMMs."""
    overlap_chunks = EP_OVERLAP_CHUNKS if overlap else 1
    for chunk in chunks:
        for block in chunk.blocks():
            moe = block.feed_forward
            if not isinstance(moe, MoE):
                continue
            old = moe.experts
            dim, hidden = old.w1.shape[1], old.w1.shape[2]
            with torch.device(old.w1.device):
                moe.experts = ExpertParallelExperts(
                    moe.n_experts, dim, hidden, group, ep, overlap_chunks=overlap_chunks, clamped=old.clamped
                ).to(old.w1.dtype)


def is_expert(name: str) -> bool:
    return ".experts." in name
