"""Time one CPU training step of fived's Transformer against Hugging Face `LlamaForCausalLM`.

Both models get the same config, the same initial weights (ours, copied into the HF model), the same
batch of random token ids, the same dtype, the same loss (mean cross-entropy over every token,
computed by the same line for both) and the same optimizer (torch.optim.AdamW). A step is
forward + loss + backward + AdamW step + zero_grad. The first step's losses must agree (this proves
both run the same model on the same data); then warmup steps are run and discarded, and the timed
steps alternate between the two models. The last line printed is the ratio of the median step times.

    pip install -c constraints.txt -e '.[bench]'
    python benchmarks/bench_vs_hf.py                      # float32, 1 thread
    python benchmarks/bench_vs_hf.py --dtype bfloat16 --threads 4
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import statistics
import sys
import time


def fix_threads_before_torch() -> None:
    """The thread count must be fixed before torch (and its OpenMP runtime) is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=1)
    threads = max(1, pre.parse_known_args()[0].threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


if __name__ == "__main__":  # (not when another script imports this one for its helpers)
    fix_threads_before_torch()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fived.config import PRESETS, ModelConfig, model_preset  # noqa: E402
from fived.model.init import init_weights  # noqa: E402
from fived.model.transformer import build_model  # noqa: E402

# A CPU-sized default: the "tiny" preset widened so a step is tens of milliseconds on one thread.
DEFAULT_MODEL = "cpu-bench"
BENCH_SHAPES = {
    DEFAULT_MODEL: dict(PRESETS["tiny"], dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=4096),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# First-step loss agreement. bfloat16 rounds differently in the two implementations (HF's RMSNorm
# upcasts to float32 internally, its RoPE tables are float32), so only float32 is held to 1e-5.
LOSS_TOL = {"float32": 1e-5, "bfloat16": 5e-2}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [DEFAULT_MODEL, *PRESETS]
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"preset name (dense only): {', '.join(names)}; default {DEFAULT_MODEL} = tiny with "
        "dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, vocab_size=4096",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence fed to the model")
    p.add_argument("--steps", type=int, default=60, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model (after the check step)")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="parameter and compute dtype of both models (the loss is computed in float32)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (also OMP/MKL_NUM_THREADS)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.model in BENCH_SHAPES:
        args.cfg = ModelConfig(name=args.model, **BENCH_SHAPES[args.model])
    elif args.model in PRESETS:
        args.cfg = model_preset(args.model)
    else:
        p.error(f"--model {args.model}: unknown preset; valid: {', '.join(names)}")
    if args.cfg.is_moe:
        p.error(
            f"--model {args.model}: a mixture-of-experts preset (n_experts={args.cfg.n_experts}); "
            "LlamaForCausalLM is dense, so only dense presets can be compared"
        )
    if min(args.batch, args.seq_len, args.steps) < 1 or args.warmup < 0:
        p.error("--batch, --seq-len and --steps must be >= 1, --warmup >= 0")
    return args


def llama_config(cfg: ModelConfig, seq_len: int):
    """The LlamaConfig that describes exactly the same network as `cfg`."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        max_position_embeddings=max(seq_len, 2048),
        initializer_range=cfg.init_std,
        use_cache=False,
        attn_implementation="sdpa",
    )
    # transformers 5 moved rope_theta into rope_parameters; 4.x takes it directly.
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    else:
        kwargs["rope_theta"] = cfg.rope_theta
    hf_cfg = LlamaConfig(**kwargs)
    theta = (getattr(hf_cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(hf_cfg, "rope_theta", None))
    assert theta == cfg.rope_theta, f"LlamaConfig rope_theta {theta} != {cfg.rope_theta}"
    return hf_cfg


def hf_llama(cfg: ModelConfig, seq_len: int):
    """Hugging Face's LlamaForCausalLM for `cfg` (its own initial weights), with SDPA attention."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(llama_config(cfg, seq_len))
    assert hf.config._attn_implementation == "sdpa", hf.config._attn_implementation
    return hf


def hf_name(ours: str) -> str:
    """Our parameter name -> LlamaForCausalLM's."""
    if ours == "output.weight":
        return "lm_head.weight"
    name = ours.replace("tok_embeddings.", "embed_tokens.")
    for a, b in (
        ("attention.wq.", "self_attn.q_proj."),
        ("attention.wk.", "self_attn.k_proj."),
        ("attention.wv.", "self_attn.v_proj."),
        ("attention.wo.", "self_attn.o_proj."),
        ("feed_forward.w1.", "mlp.gate_proj."),
        ("feed_forward.w3.", "mlp.up_proj."),
        ("feed_forward.w2.", "mlp.down_proj."),
        ("attention_norm.", "input_layernorm."),
        ("ffn_norm.", "post_attention_layernorm."),
    ):
        name = name.replace(a, b)
    return "model." + name


@torch.no_grad()
def copy_weights(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    hf_params = dict(hf.named_parameters())
    ours_params = dict(ours.named_parameters())
    assert len(hf_params) == len(ours_params), (sorted(hf_params), sorted(ours_params))
    for name, p in ours_params.items():
        target = hf_params[hf_name(name)]
        assert target.shape == p.shape, (name, target.shape, p.shape)
        target.copy_(p)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in (at least) float32, like fived.parallel.lm_loss_sum; same for both."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_step(model, forward, lr: float):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = loss_fn(forward(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main() -> int:
    args = parse_args()
    torch.set_num_threads(max(1, args.threads))
    import transformers

    cfg, dtype = args.cfg, DTYPES[args.dtype]

    ours = build_model(cfg, device="cpu", dtype=torch.float32)
    init_weights(ours, args.seed)
    hf = hf_llama(cfg, args.seq_len)
    copy_weights(ours, hf)  # in float32, then both are cast the same way
    ours.to(dtype).train()
    hf.to(dtype).train()

    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    steps = {
        "fived": make_step(ours, ours, args.lr),
        "transformers": make_step(hf, lambda x: hf(input_ids=x, use_cache=False).logits, args.lr),
    }

    # Sanity check: the first step (same weights, same batch) must give the same loss.
    first = {k: f(inputs, targets) for k, f in steps.items()}
    diff = abs(first["fived"] - first["transformers"])
    tol = LOSS_TOL[args.dtype]
    n_params = sum(p.numel() for p in ours.parameters())
    print(
        f"fived vs transformers {transformers.__version__} | torch {torch.__version__} | "
        f"threads {torch.get_num_threads()} | dtype {args.dtype}"
    )
    print(
        f"model {args.model}: dim={cfg.dim} n_layers={cfg.n_layers} n_heads={cfg.n_heads} "
        f"n_kv_heads={cfg.n_kv_heads} ffn_dim={cfg.ffn_dim} vocab={cfg.vocab_size} "
        f"tie={cfg.tie_embeddings} params={n_params / 1e6:.2f}M"
    )
    print(
        f"batch {args.batch} x seq_len {args.seq_len} = {args.batch * args.seq_len} tokens/step | "
        f"steps {args.steps} timed, {args.warmup} warmup"
    )
    print(
        f"first-step loss: fived {first['fived']:.7f}  transformers {first['transformers']:.7f}  "
        f"|diff| {diff:.2e} (tol {tol:g})"
    )
    if not diff <= tol:
        print("SANITY CHECK FAILED: the two models do not compute the same loss", file=sys.stderr)
        return 1

    for _ in range(args.warmup):
        for f in steps.values():
            f(inputs, targets)

    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    gc.collect()
    gc.disable()
    try:
        for i in range(args.steps):
            for k in order if i % 2 == 0 else order[::-1]:  # alternate which model goes first
                t0 = time.perf_counter()
                steps[k](inputs, targets)
                times[k].append(time.perf_counter() - t0)
    finally:
        gc.enable()

    med = {k: statistics.median(v) for k, v in times.items()}
    tok = args.batch * args.seq_len
    print()
    print(f"{'model':<14}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'tokens/s':>11}")
    for k, v in times.items():
        print(f"{k:<14}{med[k] * 1e3:>11.2f}{min(v) * 1e3:>9.2f}{max(v) * 1e3:>9.2f}{tok / med[k]:>11.0f}")
    print(f"ratio (fived / transformers, median step time): {med['fived'] / med['transformers']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
