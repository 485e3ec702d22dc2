"""The layout rules that read a layout's micro-batches, sequence parallelism and activation
checkpointing: what the planner varies over each layout core (its mesh, ZeRO stage and schedule).
`fived.layout.rules.layout_errors` asks each at its place in the rules' order (the first broken rule
is the one reported); `per_layout_errors` asks them alone, in that order, so that the planner checks
the other rules once per core (`fived.planner.search.layout_refusal`).
"""

from __future__ import annotations

from fived.layout.bounds import largest_divisor, nearest_multiple
from fived.layout.layout import PP_SCHEDULES, SPLIT_BACKWARD

# the `Layout` fields only these rules read (micro_batch: through train.microbatches)
LAYOUT_FIELDS = ("micro_batch", "sp", "checkpointing")
# everything `per_layout_rules` reads: of the layout (or parallel config), of the train config, and dp
PARALLEL_READ = ("sp", "tp", "pp_schedule", "pp", "etp", "cp")
TRAIN_READ = ("seq_len", "global_batch", "microbatches", "activation_checkpointing")


def sp_needs_tp(need, p) -> None:
    need(
        not p.sp or p.tp > 1,
        lambda: (
            "parallel.sp",
            p.sp,
            "sequence parallelism splits over tp ranks: it needs tp > 1",
            "add --tp 2, or drop --sp",
        ),
    )


def pipeline_microbatches(need, p, t) -> None:
    """The schedules' rules on micro-batches and checkpointing (of a known `p.pp_schedule`)."""
    need(
        p.pp_schedule != "dualpipev" or p.pp == 1 or t.microbatches >= 2 * p.pp,
        lambda: (
            "train.microbatches",
            t.microbatches,
            f"dualpipev needs at least as many micro-batches as stages (2*pp={2 * p.pp})",
            f"e.g. --microbatches {2 * p.pp}",
        ),
    )
    need(
        p.pp == 1 or t.microbatches >= p.pp,
        lambda: ("train.microbatches", t.microbatches, f"must be >= pp={p.pp}", f"e.g. --microbatches {p.pp}"),
    )
    need(
        p.pp == 1 or p.pp_schedule not in SPLIT_BACKWARD or t.activation_checkpointing != "selective",
        lambda: (
            "train.activation_checkpointing",
            t.activation_checkpointing,
            f"selective checkpointing cannot run under {p.pp_schedule}: its split backward (input, then weight "
            f"gradients) would replay the cached ops twice, which torch refuses",
            "use --train.activation_checkpointing full, or --pp-schedule 1f1b/interleaved-1f1b",
        ),
    )


def folded_sp(need, p) -> None:
    """(of folded experts, `fived.layout.expert_rules`)"""
    need(
        p.sp,
        lambda: (
            "parallel.etp",
            p.etp,
            "folded experts route each tp rank's own sequence shard: it needs sequence parallelism",
            "add --sp, or use --parallel.etp 0",
        ),
    )


def sp_seq_len(need, p, t) -> None:
    need(
        not p.sp or t.seq_len % (p.tp * p.cp) == 0,
        lambda: (
            "train.seq_len",
            t.seq_len,
            f"must be divisible by tp*cp={p.tp * p.cp} with --sp",
            f"e.g. --seq-len {nearest_multiple(t.seq_len, p.tp * p.cp)}",
        ),
    )


def microbatches_positive(need, t) -> None:
    need(t.microbatches >= 1, lambda: ("train.microbatches", t.microbatches, "must be >= 1", "e.g. --microbatches 1"))


def local_microbatches(need, t, dp: int) -> None:
    if dp >= 1 and t.global_batch % dp == 0 and t.microbatches >= 1:
        local = t.global_batch // dp
        need(
            local % t.microbatches == 0,
            lambda: (
                "train.microbatches",
                t.microbatches,
                f"must divide the per-rank batch global_batch/dp={local}",
                f"e.g. --microbatches {largest_divisor(local, t.microbatches)}",
            ),
        )


def per_layout_rules(need, p, t, dp: int) -> None:
    """These rules alone, in `layout_errors`'s order and under its conditions (a known schedule, folding)."""
    sp_needs_tp(need, p)
    if p.pp_schedule in PP_SCHEDULES:
        pipeline_microbatches(need, p, t)
    if p.etp == 1 and p.tp > 1:  # (`Layout.folded`)
        folded_sp(need, p)
    sp_seq_len(need, p, t)
    microbatches_positive(need, t)
    local_microbatches(need, t, dp)
