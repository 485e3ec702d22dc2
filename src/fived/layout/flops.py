"""Model FLOPs per token, for MFU (the runtime's metrics and the planner read this one count).

FLOPs per token (documented formula, as PaLM appendix B and torchtitan):
    6 * N_matmul + 12 * (n_layers + mtp_depth) * n_heads * head_dim * seq_len
where N_matmul counts the parameters that take part in a matrix multiply for one token: every
parameter except the input embedding (a lookup), with only top_k routed experts for MoE layers
(plus shared experts and the router), and the multi-token prediction modules (each a block, its
2d -> d projection and the shared head again; they run in training). The first term is forward (2N) + backward (4N); the second is
attention's QK^T and AV products, without discounting the causal mask. Activation recomputation is
not counted (this is MFU, not HFU).

A windowed layer (model.sliding_window, window w < seq s) computes the (query, key) pairs of its
band, s w - w (w - 1) / 2 of the causal s (s + 1) / 2; in the formula's units (seq_len keys per
query for a causal layer) that is 2 w - w^2 / s keys per query, which is s at w = s and about 2 w
when s >> w (`attention_keys`): the same ratio to a global layer as the pairs a kernel computes.

What fived's kernels compute for a windowed layer is more (`kernel_keys`, what the planner's time
prices): each query tile's keys from its first query - w + 1 to its last, every piece masked, none
skipped (`fived.layout.attention_tiles.window_pairs`): about 2 w pairs per query where the band has
w, and a causal kernel skips half of its square. In the formula's units (a causal kernel's) that is
twice the pairs per query, about 4 w.
"""

from __future__ import annotations

from fived.config import ModelConfig
from fived.layout.attention_tiles import window_pairs
from fived.layout.stages import layer_costs


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Parameters one token multiplies by: each layer's attention and (top_k routed + shared experts'
    and router's, or dense) feed-forward weights — the pipeline's layer costs — plus the norms' gains
    and the output head."""
    costs, head = layer_costs(cfg)
    norms = cfg.n_layers * 2 * cfg.dim + cfg.dim + cfg.mtp_depth * 5 * cfg.dim  # (an MTP module has 5)
    return int(sum(costs)) + norms + head


def layer_keys(window: int, seq_len: int) -> float:
    """Keys per query of one layer in the formula's units: seq_len for a global (causal) layer."""
    if not window or window >= seq_len:
        return float(seq_len)
    return 2.0 * window - window * window / seq_len


def attention_keys(cfg: ModelConfig, seq_len: int) -> float:
    """Keys per query summed over the layers ((n_layers + mtp_depth) x seq_len without windows: each
    multi-token prediction module's block attends globally)."""
    main = sum(layer_keys(cfg.layer_window(i), seq_len) for i in range(cfg.n_layers))
    return main + cfg.mtp_depth * float(seq_len)


def kernel_keys(window: int, seq_len: int, cp: int = 1, ulysses: int = 1) -> float:
    """Keys per query, in the formula's units, that fived's kernel calls compute for one layer on the
    busiest ring member (cp / ulysses of them) of the halves layout: a global layer's seq_len (its
    causal kernel computes half of them), a windowed one's twice its calls' pairs per query (masked
    calls skip nothing)."""
    if not window:
        return float(seq_len)
    return 2.0 * max(window_pairs(seq_len, cp, window, ulysses)) * (cp // ulysses) / seq_len


def kernel_attention_keys(cfg: ModelConfig, seq_len: int, cp: int = 1, ulysses: int = 1) -> float:
    """`attention_keys` as fived's kernels compute them (`kernel_keys`), summed over the layers."""
    main = sum(kernel_keys(cfg.layer_window(i), seq_len, cp, ulysses) for i in range(cfg.n_layers))
    return main + cfg.mtp_depth * float(seq_len)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 12.0 * cfg.n_heads * cfg.head_dim * attention_keys(cfg, seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6.0 * matmul_params_per_token(cfg) + attention_flops_per_token(cfg, seq_len)
