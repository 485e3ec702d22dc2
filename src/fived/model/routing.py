"""How a router's logits choose experts: softmax top-k (Mixtral, Qwen3-MoE) or DeepSeek-V3's sigmoid
scores with group-limited selection.

DeepSeek-V3: each expert's score is the sigmoid of its logit; the balancing bias is added to the
scores only to choose (never to the weights); the experts form n_expert_groups equal groups, a
group's rank is the sum of its two best biased scores, and a token's top_k experts are chosen
within its topk_expert_groups best groups. The weights are the chosen unbiased scores (renormalised
to sum to 1 with route_norm), times routed_scaling. The balancing statistics read the scores
normalised over the experts (the sequence-wise balance loss of the DeepSeek-V3 report).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fived.config import ModelConfig


@dataclass(frozen=True)
class Routing:
    experts: torch.Tensor  # [..., top_k] chosen expert ids
    weights: torch.Tensor  # [..., top_k] their weights (float32 or wider)
    probs: torch.Tensor  # [..., E] scores summing to 1 over the experts (balancing statistics)


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig) -> Routing:
    """Routing of `logits` [..., E] (already in float32 or wider) with the balancing `bias` [E]."""
    if cfg.router_score == "sigmoid":
        scores = logits.sigmoid()
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        scores = probs = torch.softmax(logits, dim=-1)
    choice = scores + bias.to(scores.dtype)
    if cfg.n_expert_groups > 1:
        choice = _within_best_groups(choice, cfg.n_expert_groups, cfg.topk_expert_groups)
    experts = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if cfg.route_norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cfg.routed_scaling != 1.0:
        weights = weights * cfg.routed_scaling
    return Routing(experts, weights, probs)


def _within_best_groups(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """`choice` with every expert outside a token's `keep` best groups at -inf; a group's rank is
    the sum of its two best scores."""
    grouped = choice.unflatten(-1, (groups, -1))
    rank = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = rank.topk(keep, dim=-1).indices
    allowed = torch.zeros_like(rank, dtype=torch.bool).scatter_(-1, best, True)
    return grouped.masked_fill(~allowed[..., None], float("-inf")).flatten(-2)
