"""Whether the planner's layouts can run, and why not (`layout_refusal`): the runtime's own rules
(`fived.layout.rules`), asked ~3x10^4 times a search. The rules that read only a layout's core (all but
`fived.layout.batch_rules.LAYOUT_FIELDS`, which the search varies over each core) are asked once per
core; the refusal reported is the rules' first, as `layout_errors` orders them.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from operator import attrgetter

from fived.config import Checkpointing, Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from fived.layout import batch_rules
from fived.layout.layout import Layout
from fived.layout.rules import core_layout_errors, layout_errors, per_layout_errors
from fived.layout.schedule_sim import check_schedule
from fived.layout.stages import model_key, model_of
from fived.planner.layout_cache import layout_memo
from fived.planner.runtimes import OVERLAP_SWITCHES, with_overlap


def is_valid(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int) -> bool:
    """Whether `layout_refusal` has nothing against `layout`."""
    return CoreValidity(model, layout, seq_len, global_batch).accepts(layout)


class CoreValidity:
    """`is_valid` of the layouts that share one core (they differ in `batch_rules.LAYOUT_FIELDS` alone,
    as a search's activation options of one state do): the core's rules and the folded experts' asked
    once, each layout's own (the per-layout rules, its micro-batches' and its schedule's) per layout.
    A layout is valid iff `layout_refusal`'s checks find nothing, in whatever order they are asked."""

    __slots__ = ("core_ok", "global_batch", "seq_len")

    def __init__(self, model: ModelConfig, core: Layout, seq_len: int, global_batch: int) -> None:
        self.seq_len, self.global_batch = seq_len, global_batch
        key = model_key(model)
        self.core_ok = _folded_ok(model, core) and not _core_errors(key, _runnable(core), seq_len, global_batch)

    def accepts(self, layout: Layout) -> bool:
        """Whether `layout` (of this core) can run."""
        global_batch = self.global_batch
        if not self.core_ok or global_batch % (layout.dp * layout.micro_batch):
            return False
        t = _train_config(self.seq_len, global_batch, layout.microbatches(global_batch), layout.checkpointing)
        if _per_layout_errors(_runnable(layout), t):
            return False
        try:
            check_schedule(layout.pp_schedule, layout.pp, layout.pp_virtual, t.microbatches)
        except ValueError:
            return False
        return True


def _runnable(layout: Layout) -> Layout:
    """The layout whose rules fived's checks ask: another runtime's expert tensor parallelism (etp > 1,
    which fived does not run) checked by `_folded_ok` instead, its experts as ep 1 here."""
    return layout if layout.runnable else layout.with_(ep=1, etp=0)


def _folded_ok(model: ModelConfig, layout: Layout) -> bool:
    """Megatron-Core's rules for another runtime's expert tensor parallelism: ep*etp ranks divide
    dp*cp*tp, etp divides tp and the expert width (fived's own layouts, etp 0 or 1: nothing to check)."""
    return layout.runnable or (
        model.is_moe
        and model.n_experts % layout.ep == 0
        and layout.tp % layout.etp == 0
        and model.expert_dim % layout.etp == 0
        and layout.stage_ranks % (layout.ep * layout.expert_tp) == 0  # (ep x edp x etp: `Layout.edp`'s cut)
    )


def with_usable_overlap(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int, *, fp8: bool) -> Layout:
    """`layout` with every overlap fived has for it (`with_overlap`) that the runtime's rules accept: all
    of them, else without the switches a rule refuses (the overlapped data-parallel reductions and
    gathers: multi-token prediction under a pipeline; tp's overlap: attention biases under tp; or
    both), else none. The switches are a core's (`_core_errors`), so is the choice: asked once per core
    (`_usable_switches`; explore asks every micro-batch size and checkpointing of each)."""
    switches = _usable_switches(model_key(model), layout, seq_len, global_batch, fp8)
    return layout.with_(**dict(zip(OVERLAP_SWITCHES, switches)))


_switch_values = attrgetter(*OVERLAP_SWITCHES)


_TP_OFF = {"tp_overlap": False}
_DP_OFF = {"overlap_grad_reduce": False, "overlap_param_gather": False}


def layout_refusal(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int) -> ConfigError | None:
    """Why `layout` cannot run (None if it can): the runtime's own checks and their one-line reason
    first (MoE parallel folding, etp 1, is the runtime's: its rules are fived's); another runtime's
    expert tensor parallelism that fived does not run (planner-only) by Megatron-Core's rules instead
    for its experts (ep*etp ranks divide dp*cp*tp, etp divides tp and the expert width); then the micro-batch size
    and torch's schedule rules."""
    t = _train_config(seq_len, global_batch, layout.microbatches(global_batch), layout.checkpointing)
    error = first_rule_error(model, _runnable(layout), t)
    if error is not None:
        return error
    if not _folded_ok(model, layout):
        return ConfigError("etp", layout.etp, "the folded expert layout breaks Megatron-Core's rules", "e.g. etp 0")
    if global_batch % (layout.dp * layout.micro_batch):  # (no flags express it: microbatches would round)
        return ConfigError(
            "micro_batch",
            layout.micro_batch,
            f"must divide the per-rank batch global_batch/dp={global_batch // layout.dp}",
            "e.g. micro_batch 1",
        )
    try:  # what torch's schedule constructors refuse (micro-batch rounds)
        check_schedule(layout.pp_schedule, layout.pp, layout.pp_virtual, t.microbatches)
    except ValueError as e:
        return ConfigError("parallel.pp_schedule", layout.pp_schedule, str(e), "e.g. --pp-schedule 1f1b")
    return None


def first_rule_error(model: ModelConfig, layout: Layout, train: TrainConfig) -> ConfigError | None:
    """`layout_errors`' first error of `layout` with `train` (`_train_config`'s), its core's rules asked
    once per core."""
    core = _core_errors(model_key(model), layout, train.seq_len, train.global_batch)
    rest = _per_layout_errors(layout, train)
    if core and rest:  # (which one the rules ask first: their order decides)
        return _first_of_both(model, layout, train, rest[0])
    either = core or rest  # (either alone is `layout_errors`: see `core_layout_errors`)
    return either[0] if either else None


_PER_LAYOUT: dict = {}
_parallel_read, _train_read = attrgetter(*batch_rules.PARALLEL_READ), attrgetter(*batch_rules.TRAIN_READ)


def _per_layout_errors(layout: Layout, train: TrainConfig) -> list[ConfigError]:
    """`per_layout_errors` of `layout` with `train`, once per value of what its rules read (a plan asks
    ~10^5 layouts, each rule's arguments from a handful of values). The list is shared: not to be changed."""
    k = (_parallel_read(layout), _train_read(train), layout.dp)
    found = _PER_LAYOUT.get(k)
    if found is None:
        if len(_PER_LAYOUT) >= 65536:
            _PER_LAYOUT.clear()
        found = _PER_LAYOUT[k] = per_layout_errors(layout, train, layout.dp)
    return found


_FIRST_OF_BOTH: dict = {}


def _first_of_both(model: ModelConfig, layout: Layout, train: TrainConfig, first_rest: ConfigError) -> ConfigError:
    """`layout_errors`' first error where the core's rules and `per_layout_errors` both have one: the
    core's first (one per core) or `first_rest`, whichever rule the rules ask first; so the same for
    every layout of the core whose per-layout rules break first with `first_rest` (asked once)."""
    k = (model_key(model), _core_values(layout), train.seq_len, train.global_batch, str(first_rest))
    found = _FIRST_OF_BOTH.get(k)
    if found is None:
        if len(_FIRST_OF_BOTH) >= 65536:
            _FIRST_OF_BOTH.clear()
        cfg = Config(model=model, parallel=_parallel_config(_parallel_values(layout)), train=train)
        found = _FIRST_OF_BOTH[k] = layout_errors(cfg, layout.world)[0]
    return found


# the layout fields the rules but `per_layout_errors`' read (a core: the planner varies the others over it)
_core_values = attrgetter(*(f.name for f in fields(Layout) if f.name not in batch_rules.LAYOUT_FIELDS))


@layout_memo(maxsize=65536, values=_core_values)
def _core_errors(key: tuple, layout: Layout, seq_len: int, global_batch: int) -> list[ConfigError]:
    """`core_layout_errors` of `layout` (runnable: see `layout_refusal`), once per core."""
    t = _train_config(seq_len, global_batch, layout.microbatches(global_batch), layout.checkpointing)
    return core_layout_errors(model_of(key), layout, t, layout.world)  # (the layout: its ParallelConfig's fields)


@layout_memo(maxsize=65536, values=_core_values)
def _usable_switches(key: tuple, layout: Layout, seq_len: int, global_batch: int, fp8: bool) -> tuple:
    """`with_usable_overlap`'s switch values for `layout`'s core (the order asks the fewest cores of a
    search: a layout refused whatever its overlaps is known after three)."""
    full = with_overlap(layout, fp8=fp8)
    for candidate in (full, full.with_(**_DP_OFF)):
        if not _core_errors(key, candidate, seq_len, global_batch):
            return _switch_values(candidate)
    if _core_errors(key, layout, seq_len, global_batch):  # (refused whatever its overlaps: its own reason)
        return _switch_values(layout)
    for candidate in (full.with_(**_TP_OFF), full.with_(**_TP_OFF, **_DP_OFF)):
        if not _core_errors(key, candidate, seq_len, global_batch):
            return _switch_values(candidate)
    return _switch_values(layout)


# (the rules only read these configs: one object per distinct value, not one per layout asked)
_PARALLEL_NAMES = tuple(f.name for f in fields(ParallelConfig))
_parallel_values = attrgetter(*_PARALLEL_NAMES)


@functools.lru_cache(maxsize=65536)
def _parallel_config(values: tuple) -> ParallelConfig:
    return ParallelConfig(**dict(zip(_PARALLEL_NAMES, values)))


@functools.lru_cache(maxsize=4096)
def _train_config(seq_len: int, global_batch: int, microbatches: int, checkpointing: Checkpointing) -> TrainConfig:
    return TrainConfig(
        seq_len=seq_len, global_batch=global_batch, microbatches=microbatches, activation_checkpointing=checkpointing
    )
