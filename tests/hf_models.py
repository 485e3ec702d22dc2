"""Tiny random Hugging Face models (built with transformers, saved locally) for the import, export
and generation tests, and a float64 mode for transformers' forward.

transformers computes RMSNorm, rotary angles (and their inverse frequencies) and router
probabilities in float32 whatever the model's dtype. In float64 tests `Float64Everywhere` turns
every float32 request inside its block into float64, so that the comparison measures fived's
import (names, layouts, the model's arithmetic), not transformers' float32 islands.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

VOCAB = 256  # the byte tokenizer's: the bundled corpus trains these models without a tokenizer.json


def _swap(value):
    return torch.float64 if value is torch.float32 else value


class Float64Everywhere(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: _swap(v) for k, v in (kwargs or {}).items()}
        args = tuple(_swap(a) for a in args)
        if func is torch.Tensor.float:
            func, args = torch.Tensor.double, args[:1]
        return func(*args, **kwargs)


def hf_config(kind: str, **extra):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
    )
    common.update({k: extra.pop(k) for k in list(extra) if k in common})
    if kind == "llama":
        return transformers.LlamaConfig(**common, **extra)
    if kind == "llama3.1":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        return transformers.LlamaConfig(**common, rope_parameters=rope, **extra)
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, **extra)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=32,
            norm_topk_prob=False,
            **extra,
        )
    if kind == "gpt_oss":  # every feature of tiny-gpt-oss: windows of 8 on even layers, YaRN untruncated
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
        common.update(max_position_embeddings=64)  # (= factor x original, as transformers expects)
        values = dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
        values.update(extra)
        return transformers.GptOssConfig(**common, rope_parameters=rope, **values)
    if kind == "gemma3_text":  # every feature of tiny-gemma3: 5 windowed layers of 8 to 1 global, rope x8 there
        rope = {
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
        common.update(num_hidden_layers=6, rms_norm_eps=1e-6)
        values = dict(
            head_dim=32,
            query_pre_attn_scalar=16,
            sliding_window=8,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
            rope_parameters=rope,
        )
        values.update(extra)
        return transformers.Gemma3TextConfig(**common, **values)
    if kind == "deepseek_v3":  # every feature of tiny-deepseek-v3, interleaved rotary weights as released
        common.update(num_key_value_heads=4, intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=64)
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 32,
            "beta_slow": 1,
        }
        values = dict(
            num_hidden_layers=3,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=10,
            rope_parameters=rope,
            rope_interleave=True,
        )
        values.update(extra)
        common["num_hidden_layers"] = values.pop("num_hidden_layers")
        return transformers.DeepseekV3Config(**common, **values)
    raise ValueError(kind)


def save_hf_model(kind: str, directory, seed: int = 0, dtype=torch.float32, **extra):
    """A random transformers model of `kind` saved to `directory`; returns the model (eval mode).
    Weights are redrawn with std 0.2 (norms around 1) so that logits and routing are far from flat."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(kind, **extra),
        # (GPT-OSS's sinks: eager only; Gemma 3: its reference path)
        attn_implementation="eager" if kind in ("gpt_oss", "gemma3_text") else "sdpa",
        experts_implementation="eager",
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (DeepSeek's routing bias: trained, so imported)
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model = model.to(dtype).eval()
    model.save_pretrained(directory)
    return model


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits for `ids` ([b, s]); in float64 with its float32 parts made float64."""
    with torch.no_grad():
        if next(model.parameters()).dtype == torch.float64:
            with Float64Everywhere():
                _recompute_rope(model)
                return model(ids).logits
        return model(ids).logits


def _recompute_rope(model) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for module in model.modules():
        if isinstance(getattr(module, "rope_type", None), dict):  # (Gemma 3: one table per layer type)
            for layer_type, rope_type in module.rope_type.items():
                init = (
                    module.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
                )
                setattr(module, f"{layer_type}_inv_freq", init(module.config, layer_type=layer_type)[0])
            continue
        if hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            init = (
                module.compute_default_rope_parameters
                if module.rope_type == "default"
                else ROPE_INIT_FUNCTIONS[module.rope_type]
            )
            module.inv_freq, _ = init(module.config)
