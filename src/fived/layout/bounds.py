"""The ranges a config's numbers must lie in before anything is built: a learning rate of inf or
-1e-3, betas outside [0, 1), `--model.n_layers 100000` or `--steps 1e23` are refused in one line
(`ConfigError`: field, value, rule, a valid value) instead of writing NaN checkpoints or running the
allocator out of memory. The integer bounds are generous (well beyond any published model) and only
there to turn typos into errors; whether a layout fits in memory is fived.launch.memory_fit's question.
"""

from __future__ import annotations

import math

from fived.config import Config, ConfigError, config_fields


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is at most `at_most` (1 if none larger): the valid value the
    layout rules suggest."""
    # (from the top down: the planner asks for every layout it weighs, usually of a divisor itself)
    return next((d for d in range(max(at_most, 1), 0, -1) if n % d == 0), 1)


def nearest_multiple(value: int, base: int) -> int:
    """The multiple of `base` nearest to `value` (at least `base`; ties go up)."""
    base = max(base, 1)
    return max(base, round(value / base + 1e-9) * base) if value % base else value


# (field, lowest, highest, a valid example): inclusive integer ranges.
INTEGER_BOUNDS = (
    ("model.vocab_size", 2, 2**24, 32000),
    ("model.dim", 2, 2**17, 4096),
    ("model.n_layers", 1, 4096, 32),
    ("model.n_heads", 1, 4096, 32),
    ("model.n_kv_heads", 1, 4096, 8),
    ("model.ffn_dim", 1, 2**20, 14336),
    ("model.head_size", 0, 4096, 0),
    ("model.n_experts", 0, 4096, 8),
    ("model.top_k", 0, 4096, 2),
    ("model.moe_ffn_dim", 0, 2**20, 0),
    ("model.n_shared_experts", 0, 64, 1),
    ("model.n_dense_layers", 0, 4096, 0),
    ("model.rope_original_max_len", 1, 2**24, 8192),
    ("model.kv_lora_rank", 0, 2**17, 0),
    ("model.q_lora_rank", 0, 2**17, 0),
    ("model.qk_nope_head_dim", 0, 4096, 128),
    ("model.qk_rope_head_dim", 0, 4096, 64),
    ("model.v_head_dim", 1, 4096, 128),
    ("model.n_expert_groups", 1, 4096, 1),
    ("model.topk_expert_groups", 1, 4096, 1),
    ("train.steps", 1, 10**12, 200),
    ("train.seq_len", 2, 2**24, 64),
    ("train.global_batch", 1, 2**24, 16),
    ("train.microbatches", 1, 2**20, 1),
    ("train.warmup_steps", 0, 10**12, 20),
    ("train.decay_steps", 0, 10**12, 0),
    ("train.seed", 0, 2**63 - 1, 0),
    ("train.log_every", 1, 10**12, 10),
    ("train.eval_every", 0, 10**12, 0),
    ("train.eval_batches", 0, 2**24, 8),
    ("train.max_restarts", 0, 10**6, 2),
    ("train.spike_window", 1, 10**6, 20),
    ("train.max_rollbacks", 0, 10**6, 3),
    ("train.muon_ns_steps", 1, 100, 5),
    ("checkpoint.every", 0, 10**12, 100),
    ("checkpoint.keep", 0, 10**6, 3),
)  # (the parallel sizes: fived.layout.rules, against the world size)

# (field, rule, test, a valid example): every one also must be finite.
FLOAT_RULES = (
    ("train.lr", "must be > 0", lambda v: v > 0, "3e-3"),
    ("train.min_lr_ratio", "must be in [0, 1]", lambda v: 0 <= v <= 1, "0.1"),
    ("train.decay_fraction", "must be in (0, 1]", lambda v: 0 < v <= 1, "0.2"),
    ("train.beta1", "must be in [0, 1)", lambda v: 0 <= v < 1, "0.9"),
    ("train.beta2", "must be in [0, 1)", lambda v: 0 <= v < 1, "0.95"),
    ("train.muon_lr", "must be >= 0 (0: train.lr)", lambda v: v >= 0, "0.02"),
    ("train.muon_momentum", "must be in [0, 1)", lambda v: 0 <= v < 1, "0.95"),
    ("train.muon_bucket_mb", "must be > 0 (MiB of whole matrices per rank)", lambda v: v > 0, "256"),
    ("train.eps", "must be > 0", lambda v: v > 0, "1e-8"),
    ("train.weight_decay", "must be >= 0", lambda v: v >= 0, "0.1"),
    ("train.grad_clip", "must be >= 0 (0: no clipping)", lambda v: v >= 0, "1.0"),
    ("train.spike_factor", "must be 0 (no spike check) or > 1", lambda v: v == 0 or v > 1, "5"),
    ("train.collective_timeout_s", "must be in (0, 1e7] seconds", lambda v: 0 < v <= 1e7, "600"),
    ("train.preempt_grace_s", "must be in [0, 1e7] seconds", lambda v: 0 <= v <= 1e7, "60"),
    ("train.peak_tflops", "must be >= 0 (0: look it up)", lambda v: v >= 0, "0"),
    ("model.rope_theta", "must be > 0", lambda v: v > 0, "10000"),
    ("model.norm_eps", "must be > 0", lambda v: v > 0, "1e-5"),
    ("model.init_std", "must be > 0", lambda v: v > 0, "0.02"),
    ("model.capacity_factor", "must be >= 0 (0: dropless)", lambda v: v >= 0, "0"),
    ("model.aux_loss_coef", "must be >= 0", lambda v: v >= 0, "0.01"),
    ("model.router_bias_rate", "must be >= 0", lambda v: v >= 0, "0"),
    ("model.routed_scaling", "must be > 0", lambda v: v > 0, "1"),
    ("model.rope_beta_fast", "must be > 0", lambda v: v > 0, "32"),
    ("model.rope_beta_slow", "must be > 0", lambda v: v > 0, "1"),
    ("model.rope_mscale", "must be >= 0 (0: absent)", lambda v: v >= 0, "0"),
    ("model.rope_mscale_all_dim", "must be >= 0 (0: absent)", lambda v: v >= 0, "0"),
)


def ns_coefficients(text: str, steps: int) -> list[tuple[float, ...]] | None:
    """train.muon_ns_coefficients as one (a, b, c) per iteration: one triple for all, or one per
    iteration separated by ";". None when it is not that."""
    try:
        triples = [tuple(float(x) for x in part.split(",")) for part in text.split(";")]
    except ValueError:
        return None
    if any(len(t) != 3 or not all(map(math.isfinite, t)) for t in triples) or len(triples) not in (1, steps):
        return None
    return triples * steps if len(triples) == 1 else triples


def _value(cfg: Config, dotted: str):
    section, _, name = dotted.partition(".")
    return getattr(getattr(cfg, section), name)


def _flag(dotted: str) -> str:
    return f"--{dotted}"


def number_errors(cfg: Config) -> list[ConfigError]:
    """Every config number outside its range, and every unknown choice, as one-line errors."""
    errs = []
    for dotted, lowest, highest, int_example in INTEGER_BOUNDS:
        value = _value(cfg, dotted)
        if not lowest <= value <= highest:
            rule = f"must be >= {lowest}" if value < lowest else f"must be <= {highest} (far beyond any real run)"
            errs.append(ConfigError(dotted, value, rule, f"e.g. {_flag(dotted)} {int_example}"))
    for dotted, rule, ok, example in FLOAT_RULES:
        value = _value(cfg, dotted)
        if not (math.isfinite(value) and ok(value)):
            errs.append(
                ConfigError(
                    dotted,
                    value,
                    rule + (" and finite" if not math.isfinite(value) else ""),
                    f"e.g. {_flag(dotted)} {example}",
                )
            )
    for f in config_fields():  # (a config built in Python: flags and TOML files are checked as they are read)
        value = getattr(getattr(cfg, f.section), f.attr)
        if f.choices is not None and value not in f.choices:
            errs.append(
                ConfigError(
                    f"{f.section}.{f.key}",
                    value,
                    "must be one of " + ", ".join(map(str, f.choices)),
                    f"e.g. {_flag(f.section + '.' + f.key)} {f.default}",
                )
            )
    m = cfg.model
    if m.is_moe and m.n_dense_layers >= m.n_layers:  # (no layer would have experts: a dense model by another name)
        errs.append(
            ConfigError(
                "model.n_dense_layers",
                m.n_dense_layers,
                f"must be < model.n_layers={m.n_layers} in a mixture-of-experts model (else no layer has experts)",
                f"e.g. --model.n_dense_layers {max(0, m.n_layers - 1)}",
            )
        )
    t = cfg.train
    if t.muon_ns_steps >= 1 and ns_coefficients(t.muon_ns_coefficients, t.muon_ns_steps) is None:
        errs.append(
            ConfigError(
                "train.muon_ns_coefficients",
                t.muon_ns_coefficients,
                f"must be one finite 'a,b,c' or train.muon_ns_steps={t.muon_ns_steps} of them separated by ';'",
                "e.g. --train.muon_ns_coefficients 3.4445,-4.7750,2.0315",
            )
        )
    return errs
