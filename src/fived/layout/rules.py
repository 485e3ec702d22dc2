"""The rules a layout must meet before any rank starts, each broken rule reported as one line with a
concrete valid value (`ConfigError`): the model's own shape rules, then tensor, pipeline and data
rules, and, when the world size does not fit, the nearest layouts that do. `fived train`, `fived
verify` and the planner's search all ask these rules, so a planned layout is one the runtime accepts.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import fields

from fived.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig, choices
from fived.layout import batch_rules, deepseek_rules, window_rules
from fived.layout.bounds import largest_divisor, nearest_multiple, number_errors
from fived.layout.expert_rules import expert_rules
from fived.layout.layout import (
    CHECKPOINTING,
    COMPILE_BACKENDS,
    CP_BALANCES,
    CP_MODES,
    FP8_RECIPES,
    MUON_SCALES,
    OPTIMIZERS,
    PP_SCHEDULES,
    PRECISION_SPECS,
    Layout,
    parallel_dp,
    resolve_dp,
    stages_per_rank,
)


class _Broken:
    """`need(ok, *error)`: the rules' checks, collecting the broken ones' errors in order; with
    `per_layout` false, the rules of `fived.layout.batch_rules` are left out (see `core_layout_errors`)."""

    def __init__(self, *, per_layout: bool) -> None:
        self.errors: list[ConfigError] = []
        self.per_layout = per_layout

    def __call__(self, ok: bool, *error) -> None:
        """`error`: ConfigError's (field, value, rule, hint), or a function giving them (the rules pass
        one: their messages are built only for a broken rule, the planner asks ~10^4 layouts)."""
        if not ok:
            self.errors.append(ConfigError(*(error[0]() if callable(error[0]) else error)))


def layout_errors(cfg: Config, world: int | None) -> list[ConfigError]:
    """Every rule a layout must meet, each with a concrete way out; the first error is reported."""
    return _layout_errors(cfg.model, cfg.parallel, cfg.train, world, per_layout=True)


def core_layout_errors(
    model: ModelConfig, parallel: ParallelConfig | Layout, train: TrainConfig, world: int | None
) -> list[ConfigError]:
    """`layout_errors` of a config of these sections (`parallel`: or a `Layout`, whose fields are the
    section's) but for the rules that read the micro-batches, sp or checkpointing
    (`per_layout_errors`'): the same for every layout of one core, so the planner asks once per core.
    A layout breaks a rule iff it breaks one of either list; when only one list is empty, the other
    is `layout_errors`, in its order (the rules' conditions and early returns read the core alone)."""
    return _layout_errors(model, parallel, train, world, per_layout=False)


def per_layout_errors(parallel, train: TrainConfig, dp: int) -> list[ConfigError]:
    """The errors of `fived.layout.batch_rules`' rules alone, in `layout_errors`'s order, of a config's
    `parallel` (or a `Layout`: the same names) and `train` on `dp` data-parallel ranks (`resolve_dp`)."""
    need = _Broken(per_layout=True)
    batch_rules.per_layout_rules(need, parallel, train, dp)
    return need.errors


def _layout_errors(m: ModelConfig, p, t: TrainConfig, world: int | None, *, per_layout: bool) -> list[ConfigError]:
    dp = parallel_dp(p, world)
    need = _Broken(per_layout=per_layout)
    errs = need.errors

    for name in ("tp", "pp", "cp", "ep"):
        need(getattr(p, name) >= 1, f"parallel.{name}", getattr(p, name), "must be >= 1", f"e.g. --{name} 1")
    need(
        p.dp >= 1 or p.dp == -1,
        lambda: ("parallel.dp", p.dp, "must be >= 1 (or -1 to fill the world size)", "e.g. --dp 1"),
    )
    if errs:
        return errs
    model_parallel = p.tp * p.pp * p.cp
    if world is not None and dp == -1:
        need(
            False,
            lambda: (
                "parallel",
                f"tp{p.tp}xpp{p.pp}xcp{p.cp}",
                f"tp*pp*cp={model_parallel} must divide the number of ranks ({world})",
            ),
        )
        return errs
    if world is not None:
        need(
            dp * model_parallel == world,
            lambda: (
                "parallel",
                f"dp{dp}xtp{p.tp}xpp{p.pp}xcp{p.cp}",
                f"dp*tp*pp*cp must equal the number of ranks ({world})",
            ),
        )
    _tensor_rules(need, m, p)
    _context_rules(need, m, p)
    _pipeline_rules(need, m, p, t)
    _data_rules(need, m, p, t, dp)
    for check in window_rules.layout_checks(m, p, t.fp8):  # (the planner reads these rules too)
        need(*check)
    return errs


def _tensor_rules(need, m, p) -> None:
    need(
        m.n_heads % p.tp == 0,
        lambda: (
            "parallel.tp",
            p.tp,
            f"must divide model.n_heads={m.n_heads}",
            f"e.g. --tp {largest_divisor(m.n_heads, p.tp)}",
        ),
    )
    for name in ("ffn_dim", "moe_ffn_dim"):
        value = getattr(m, name)
        need(
            value % p.tp == 0,
            lambda name=name, value=value: (
                f"model.{name}",
                value,
                f"must be divisible by tp={p.tp}",
                f"e.g. --model.{name} {nearest_multiple(value, p.tp)}",
            ),
        )
    need(
        m.n_kv_heads % p.tp == 0 or p.tp % m.n_kv_heads == 0,
        lambda: (
            "parallel.tp",
            p.tp,
            f"must divide model.n_kv_heads={m.n_kv_heads} or be a multiple of it (kv heads are then replicated)",
            f"e.g. --tp {largest_divisor(m.n_kv_heads, p.tp)}",
        ),
    )
    if need.per_layout:
        batch_rules.sp_needs_tp(need, p)
    need(
        p.ep == 1 or m.is_moe,
        lambda: (
            "parallel.ep",
            p.ep,
            f"needs a mixture-of-experts model (model.name={m.name} is dense)",
            "use --ep 1, or a MoE model such as --model tiny-moe",
        ),
    )


def _context_rules(need, m, p) -> None:
    """Context parallelism's modes: Ulysses gives each rank of a group of u a u-th of the heads."""
    need(
        p.cp_mode in CP_MODES,
        lambda: (
            "parallel.cp_mode",
            p.cp_mode,
            "must be one of " + ", ".join(CP_MODES),
            "e.g. --parallel.cp_mode ring",
        ),
    )
    need(
        p.cp_balance in CP_BALANCES,
        lambda: (
            "parallel.cp_balance",
            p.cp_balance,
            "must be one of " + ", ".join(CP_BALANCES),
            "e.g. --parallel.cp_balance work",
        ),
    )
    if p.cp_mode == "hybrid" and p.cp > 1:
        need(
            1 < p.cp_ulysses < p.cp and p.cp % p.cp_ulysses == 0,
            lambda: (
                "parallel.cp_ulysses",
                p.cp_ulysses,
                f"hybrid context parallelism needs Ulysses groups of 2..cp/2 ranks dividing cp={p.cp}",
                f"e.g. --parallel.cp_ulysses {largest_divisor(p.cp, max(2, min(p.cp_ulysses, p.cp // 2)))}"
                if p.cp >= 4
                else "use --parallel.cp_mode ulysses (or ring) for cp=2",
            ),
        )
    if p.cp == 1 or p.cp_mode not in ("ulysses", "hybrid") or m.n_heads % p.tp:
        return
    u = p.cp if p.cp_mode == "ulysses" else p.cp_ulysses
    heads, kv = m.n_heads // p.tp, max(m.n_kv_heads // p.tp, 1)
    need(
        heads % u == 0,
        lambda: (
            "parallel.cp",
            p.cp,
            f"{p.cp_mode} context parallelism splits the {heads} query heads of a "
            f"tp rank over {u} ranks: {u} must divide them",
            "use --parallel.cp_mode ring, or a smaller cp"
            if p.cp_mode == "ulysses"
            else f"e.g. --parallel.cp_ulysses {largest_divisor(heads, u)}",
        ),
    )
    need(
        kv % u == 0 or u % kv == 0,
        lambda: (
            "parallel.cp",
            p.cp,
            f"{u} Ulysses ranks must divide the {kv} kv heads of a tp "
            f"rank, or be a multiple of them (kv heads are then repeated)",
            "use --parallel.cp_mode ring",
        ),
    )


def _pipeline_rules(need, m, p, t) -> None:
    need(
        p.pp == 1 or not m.tie_embeddings,
        lambda: (
            "model.tie_embeddings",
            m.tie_embeddings,
            "tied embeddings across pipeline stages are not supported yet",
            "set it false, or use --pp 1",
        ),
    )
    need(
        p.pp == 1 or m.mtp_depth == 0 or (p.zero <= 2 and not p.overlap_grad_reduce and not p.overlap_param_gather),
        lambda: (
            "model.mtp_depth",
            m.mtp_depth,
            "multi-token prediction under pipeline parallelism runs with ZeRO-0/1/2 without overlapped reductions "
            "(the last stage's copy of the embedding adds its gradient before the dp reduction)",
            "e.g. --zero 1 --parallel.overlap_grad_reduce false --parallel.overlap_param_gather false",
        ),
    )
    need(
        p.pp_schedule in PP_SCHEDULES,
        lambda: (
            "parallel.pp_schedule",
            p.pp_schedule,
            "must be one of " + ", ".join(PP_SCHEDULES),
            "e.g. --pp-schedule 1f1b",
        ),
    )
    if p.pp_schedule not in PP_SCHEDULES:
        return
    need(p.pp_virtual >= 1, lambda: ("parallel.pp_virtual", p.pp_virtual, "must be >= 1", "e.g. --pp-virtual 2"))
    need(
        p.pp_virtual == 1 or p.pp_schedule in ("interleaved-1f1b", "zero-bubble"),
        lambda: (
            "parallel.pp_virtual",
            p.pp_virtual,
            f"only interleaved-1f1b and zero-bubble take virtual stages ({p.pp_schedule} uses "
            f"{stages_per_rank(p.pp_schedule, 1)} per rank)",
            "use --pp-virtual 1, or --pp-schedule interleaved-1f1b",
        ),
    )
    per_rank = stages_per_rank(p.pp_schedule, max(p.pp_virtual, 1))
    stages = p.pp * per_rank if p.pp > 1 else 1
    need(
        m.n_layers >= stages,
        lambda: (
            "parallel.pp",
            p.pp,
            f"{stages} pipeline stages need at least as many layers (model.n_layers={m.n_layers})",
            f"e.g. --pp {max(1, m.n_layers // per_rank)}",
        ),
    )
    if p.pp_layers:
        try:
            counts = [int(c) for c in p.pp_layers.split(",")]
        except ValueError:
            counts = []
        even = [m.n_layers // stages + (1 if i < m.n_layers % stages else 0) for i in range(stages)]
        need(
            len(counts) == stages and all(c >= 1 for c in counts) and sum(counts) == m.n_layers,
            lambda: (
                "parallel.pp_layers",
                p.pp_layers,
                f"must list {stages} positive layer counts summing to model.n_layers={m.n_layers}",
                f"e.g. --pp-layers {','.join(map(str, even))}" if m.n_layers >= stages else "",
            ),
        )
    if need.per_layout:
        batch_rules.pipeline_microbatches(need, p, t)


def _data_rules(need, m, p, t, dp: int) -> None:
    expert_rules(need, m, p, t, dp)
    if need.per_layout:
        batch_rules.sp_seq_len(need, p, t)
    need(
        t.seq_len % (2 * p.cp) == 0 or p.cp == 1,
        lambda: (
            "train.seq_len",
            t.seq_len,
            f"must be divisible by 2*cp={2 * p.cp} (load-balanced context-parallel chunks)",
            f"e.g. --seq-len {nearest_multiple(t.seq_len, 2 * p.cp)}",
        ),
    )
    need(p.zero in (0, 1, 2, 3), lambda: ("parallel.zero", p.zero, "must be 0, 1, 2 or 3", "e.g. --zero 1"))
    need(
        p.dp_replicate >= 1 and dp >= 1 and dp % p.dp_replicate == 0,
        lambda: (
            "parallel.dp_replicate",
            p.dp_replicate,
            f"must be >= 1 and divide dp={dp} (dp = dp_replicate x dp_shard)",
            f"e.g. --dp-replicate {largest_divisor(max(dp, 1), max(p.dp_replicate, 1))}",
        ),
    )
    need(
        p.dp_replicate == 1 or p.zero >= 1,
        lambda: (
            "parallel.dp_replicate",
            p.dp_replicate,
            "replica groups (HSDP) need a sharded stage",
            "add --zero 1 (or 2, 3)",
        ),
    )
    need(
        p.reduce_dtype in ("float32", "bfloat16"),
        lambda: (
            "parallel.reduce_dtype",
            p.reduce_dtype,
            "must be float32 or bfloat16",
            "e.g. --parallel.reduce_dtype float32",
        ),
    )
    if need.per_layout:
        batch_rules.microbatches_positive(need, t)
    need(
        p.bucket_mb > 0 and math.isfinite(p.bucket_mb),
        lambda: ("parallel.bucket_mb", p.bucket_mb, "must be > 0 and finite", "e.g. --parallel.bucket_mb 25"),
    )
    need(
        not p.overlap_param_gather or p.zero in (1, 2),
        lambda: (
            "parallel.overlap_param_gather",
            p.overlap_param_gather,
            f"gathers the parameters of ZeRO-1/2 (zero={p.zero} has no separate gather; ZeRO-3 prefetches already)",
            "add --zero 1, or set it false",
        ),
    )
    need(
        not p.zero2_reduce_every_microbatch or (p.zero == 2 and p.overlap_grad_reduce),
        lambda: (
            "parallel.zero2_reduce_every_microbatch",
            p.zero2_reduce_every_microbatch,
            f"needs zero=2 with overlap_grad_reduce (its buckets; here zero={p.zero}, "
            f"overlap_grad_reduce={str(p.overlap_grad_reduce).lower()})",
            "add --zero 2 --parallel.overlap_grad_reduce true, or set it false",
        ),
    )
    need(
        t.fp8 in FP8_RECIPES,
        lambda: ("train.fp8", t.fp8, "must be one of " + ", ".join(FP8_RECIPES), "e.g. --train.fp8 rowwise"),
    )
    need(
        dp >= 1 and t.global_batch % dp == 0,
        lambda: (
            "train.global_batch",
            t.global_batch,
            f"must be divisible by dp={dp}",
            f"e.g. --global-batch {nearest_multiple(t.global_batch, max(dp, 1))}",
        ),
    )
    if need.per_layout:
        batch_rules.local_microbatches(need, t, dp)


def _model_errors(cfg: Config) -> list[ConfigError]:
    m, t, c = cfg.model, cfg.train, cfg.checkpoint
    checks = [
        (
            m.head_size > 0 or m.dim % m.n_heads == 0,
            "model.dim",
            m.dim,
            f"must be divisible by model.n_heads={m.n_heads}",
            f"e.g. --model.dim {nearest_multiple(m.dim, m.n_heads)}",
        ),
        (
            m.n_heads % max(m.n_kv_heads, 1) == 0 and m.n_kv_heads >= 1,
            "model.n_kv_heads",
            m.n_kv_heads,
            f"must be >= 1 and divide model.n_heads={m.n_heads}",
            f"e.g. --model.n_kv_heads {largest_divisor(m.n_heads, max(m.n_kv_heads, 1))}",
        ),
        (
            m.head_dim % 2 == 0,
            "model.dim",
            m.dim,
            "dim/n_heads must be even for rotary embeddings",
            f"e.g. --model.dim {nearest_multiple(m.dim, 2 * m.n_heads)}",
        ),
        (
            m.rope_scaling in (choices("model", "rope_scaling") or ()),
            "model.rope_scaling",
            m.rope_scaling,
            "must be one of " + ", ".join(choices("model", "rope_scaling") or ()),
            "e.g. --model.rope_scaling none",
        ),
        (
            m.rope_scaling != "llama3" or m.rope_high_freq_factor > m.rope_low_freq_factor > 0,
            "model.rope_high_freq_factor",
            m.rope_high_freq_factor,
            f"must exceed model.rope_low_freq_factor={m.rope_low_freq_factor} (> 0)",
            "e.g. --model.rope_high_freq_factor 4",
        ),
        (
            not m.is_moe or 1 <= m.top_k <= m.n_experts,
            "model.top_k",
            m.top_k,
            f"must be in 1..n_experts={m.n_experts}",
            f"e.g. --model.top_k {min(2, max(m.n_experts, 1))}",
        ),
        (
            t.dtype in PRECISION_SPECS,
            "train.dtype",
            t.dtype,
            "must be one of " + ", ".join(PRECISION_SPECS),
            "e.g. --dtype bfloat16",
        ),
        *deepseek_rules.model_checks(m),
        *deepseek_rules.mtp_checks(m, t.seq_len),
        *window_rules.model_checks(m),
        *window_rules.gemma_checks(m),
        *_fp8_checks(t, cfg.parallel),
        *_muon_checks(t),
        (
            t.device in ("auto", "cpu", "cuda"),
            "train.device",
            t.device,
            "must be auto, cpu or cuda",
            "e.g. --train.device auto",
        ),
        (
            t.activation_checkpointing in CHECKPOINTING,
            "train.activation_checkpointing",
            t.activation_checkpointing,
            "must be one of " + ", ".join(CHECKPOINTING),
            "e.g. --train.activation_checkpointing none",
        ),
        (
            t.compile_backend in COMPILE_BACKENDS,
            "train.compile_backend",
            t.compile_backend,
            "must be one of " + ", ".join(COMPILE_BACKENDS),
            "e.g. --train.compile_backend inductor",
        ),
        (
            t.optimizer in OPTIMIZERS,
            "train.optimizer",
            t.optimizer,
            "must be one of " + ", ".join(OPTIMIZERS),
            "e.g. --train.optimizer muon",
        ),
        (
            t.muon_scale in MUON_SCALES,
            "train.muon_scale",
            t.muon_scale,
            "must be one of " + ", ".join(MUON_SCALES),
            "e.g. --train.muon_scale rms",
        ),
        (t.steps >= 1, "train.steps", t.steps, "must be >= 1", "e.g. --steps 200"),
        (t.seq_len >= 2, "train.seq_len", t.seq_len, "must be >= 2", "e.g. --seq-len 64"),
        (t.global_batch >= 1, "train.global_batch", t.global_batch, "must be >= 1", "e.g. --global-batch 16"),
        (t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be >= 0", "e.g. --train.warmup_steps 20"),
        (t.lr > 0, "train.lr", t.lr, "must be > 0", "e.g. --train.lr 3e-3"),
        (
            t.collective_timeout_s > 0,
            "train.collective_timeout_s",
            t.collective_timeout_s,
            "must be > 0",
            "e.g. --train.collective_timeout_s 600",
        ),
        (t.max_restarts >= 0, "train.max_restarts", t.max_restarts, "must be >= 0", "e.g. --max-restarts 2"),
        (
            t.preempt_grace_s >= 0,
            "train.preempt_grace_s",
            t.preempt_grace_s,
            "must be >= 0",
            "e.g. --train.preempt_grace_s 60",
        ),
        (
            profile_window(t.profile, t.steps) is not None or not t.profile,
            "train.profile",
            t.profile,
            f"must be START:END with 1 <= START <= END <= train.steps={t.steps}",
            f"e.g. --train.profile {min(2, t.steps)}:{min(3, t.steps)}",
        ),
        (
            t.breakdown or not t.profile,
            "train.breakdown",
            t.breakdown,
            "must be true with train.profile (fived's spans label the trace)",
            "e.g. --train.breakdown true",
        ),
        (
            c.every >= 0,
            "checkpoint.every",
            c.every,
            "must be >= 0 (0: no periodic saves)",
            "e.g. --checkpoint.every 100",
        ),
        (c.keep >= 0, "checkpoint.keep", c.keep, "must be >= 0 (0: keep all)", "e.g. --checkpoint.keep 3"),
    ]
    return [ConfigError(field, value, rule, hint) for ok, field, value, rule, hint in checks if not ok]


# train.dtype values FP8 linears run with: torchao's float8 casts from float32 or bfloat16 (weights
# in bf16, or float32 under autocast); float64 is for verification, which FP8 rounding would defeat.
FP8_DTYPES = ("bfloat16", "bfloat16-autocast", "float32")


def _fp8_checks(t, p) -> list[tuple]:
    if t.fp8 == "none" or t.fp8 not in FP8_RECIPES:  # (an unknown recipe: refused by the layout rules)
        return []
    import importlib.util

    return [
        (
            t.dtype in FP8_DTYPES,
            "train.fp8",
            t.fp8,
            f"runs with train.dtype {', '.join(FP8_DTYPES)} (not {t.dtype})",
            "e.g. --dtype bfloat16",
        ),
        (
            importlib.util.find_spec("torchao") is not None,
            "train.fp8",
            t.fp8,
            "needs torchao",
            "pip install 'fived[fp8]'",
        ),
        # the overlapped regions run their own chunked GEMMs, in the compute dtype, not FP8
        (
            not (p.tp_overlap and p.tp > 1),
            "parallel.tp_overlap",
            p.tp_overlap,
            f"cannot run with train.fp8={t.fp8} yet (its fused region GEMMs are not FP8 GEMMs)",
            "drop --parallel.tp_overlap, or use --train.fp8 none",
        ),
    ]


def _muon_checks(t) -> list[tuple]:
    """Muon's options set under AdamW would change nothing: refused rather than ignored."""
    if t.optimizer != "adamw":
        return []
    out = []
    for f in fields(TrainConfig):
        if f.name.startswith("muon_"):
            default = str(f.default).lower() if isinstance(f.default, bool) else f.default
            out.append(
                (
                    getattr(t, f.name) == f.default,
                    f"train.{f.name}",
                    getattr(t, f.name),
                    "only acts with train.optimizer=muon (AdamW ignores it)",
                    f"add --train.optimizer muon, or leave it at {default}",
                )
            )
    return out


def profile_window(text: str, steps: int) -> tuple[int, int] | None:
    """train.profile "START:END" as (START, END), or None when it is empty or not a valid window."""
    first, sep, last = text.partition(":")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        return None
    start, end = int(first), int(last)
    return (start, end) if 1 <= start <= end <= steps else None


def suggest_layouts(cfg: Config, world: int, limit: int = 3) -> list[str]:
    """Valid (dp, tp, pp, cp, ep) layouts for `world` ranks, nearest to the requested one first."""
    p = cfg.parallel
    want = (resolve_dp(cfg, world), p.tp, p.pp, p.cp, p.ep)
    found = []
    for tp, pp, cp in itertools.product(range(1, world + 1), repeat=3):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        for ep in [e for e in range(1, dp * cp + 1) if (dp * cp) % e == 0]:
            trial = Config(
                model=cfg.model,
                train=cfg.train,
                data=cfg.data,
                parallel=type(p)(**{**vars(p), "dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}),
            )
            if not layout_errors(trial, world):
                dist = sum(abs(a - b) for a, b in zip((dp, tp, pp, cp, ep), want))
                found.append((dist, f"--dp {dp} --tp {tp} --pp {pp} --cp {cp} --ep {ep}"))
    return [s for _, s in sorted(found)[:limit]]


def check_model(m: ModelConfig) -> None:
    """Raise the first ConfigError of a model on its own (what `fived plan` prices: a TOML file's
    [model] table gets the checks a training run's model gets)."""
    cfg = Config(model=m)
    errs = _model_errors(cfg) or number_errors(cfg)
    if errs:
        raise errs[0]


def check_config(cfg: Config, world: int | None) -> None:
    """Raise the first ConfigError for `cfg` on `world` ranks, with the nearest valid layouts as hint.
    Called by the CLI before any process starts, and again by every rank as a guard."""
    errs = number_errors(cfg) or _model_errors(cfg) or layout_errors(cfg, world)  # (ranges first: relations divide)
    if not errs:
        return
    err = errs[0]
    if not err.hint:  # the world size does not fit the layout: other layouts, or another world size
        near = suggest_layouts(cfg, world) if world else []
        p = cfg.parallel
        ranks = max(p.dp, 1) * p.tp * p.pp * p.cp
        err = ConfigError(
            err.field,
            err.value,
            err.rule,
            ("nearest valid layouts: " + " | ".join(near)) if near else f"e.g. --nproc {ranks}",
        )
    raise err
