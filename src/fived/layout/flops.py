"""Model FLOPs per token, for MFU (the runtime's metrics and the planner read this one count).

FLOPs per token (documented formula, as PaLM appendix B and torchtitan):
    6 * N_matmul + 12 * (n_layers + mtp_depth) * n_heads * head_dim * seq_len
where N_matmul counts the parameters that take part in a matrix multiply for one token: every
parameter except the input embedding (a lookup), with only top_k routed experts for MoE layers
(plus shared experts and the router), and the multi-token prediction modules (each a block, its
2d -> d projection and the shared head again; they run in training). The first term is forward (2N) + backward (4N); the second is
attention's QK^T and AV products, without discounting the causal mask. Activation recomputation is
not counted (this is MFU, not HFU).
"""

from __future__ import annotations

from fived.config import ModelConfig
from fived.layout.stages import layer_costs


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Parameters one token multiplies by: each layer's attention and (top_k routed + shared experts'
    and router's, or dense) feed-forward weights — the pipeline's layer costs — plus the norms' gains
    and the output head."""
    costs, head = layer_costs(cfg)
    norms = cfg.n_layers * 2 * cfg.dim + cfg.dim + cfg.mtp_depth * 5 * cfg.dim  # (an MTP module has 5)
    return int(sum(costs)) + norms + head


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention_layers = cfg.n_layers + cfg.mtp_depth
    return 6.0 * matmul_params_per_token(cfg) + 12.0 * attention_layers * cfg.n_heads * cfg.head_dim * seq_len
