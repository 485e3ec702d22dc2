"""GPT-OSS's experts, as transformers' GptOssExperts computes them: each expert's gate and up
projections with biases, the clamped SwiGLU (gate clamped above at `limit`, up at +-`limit`,
gate * sigmoid(alpha * gate) * (up + 1)), and the down projection with its bias.

Expert by expert over the slots sorted by expert (plain autograd, no fused op): the biases and the
clamp are not in `fived.model.grouped_gemm`'s kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClampedSwiglu:
    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


def biased_experts(x: torch.Tensor, weights: tuple[torch.Tensor, ...], counts: torch.Tensor, act: ClampedSwiglu):
    """x [slots, dim] sorted by expert, `counts` slots per expert; weights (w1, b1, w3, b3, w2, b2):
    w1, w3 [E, dim, hidden], b1, b3 [E, hidden], w2 [E, hidden, dim], b2 [E, dim]."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):  # (as a matmul would under autocast)
        dtype = torch.get_autocast_dtype(kind)
        x, weights = x.to(dtype), tuple(w.to(dtype) for w in weights)
    w1, b1, w3, b3, w2, b2 = weights
    outs = [
        act(rows @ w1[e] + b1[e], rows @ w3[e] + b3[e]) @ w2[e] + b2[e]
        for e, rows in enumerate(torch.split(x, counts.tolist()))
    ]
    return torch.cat(outs)
