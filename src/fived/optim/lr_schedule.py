"""The learning-rate plan: a step's lr is lr x lr_multiplier(step), a function of that step and the
train.* schedule fields only, so any layout, restart or resume gives every step the same lr.

Linear warmup over warmup_steps, then, up to decay_steps (D):
  cosine    half a cosine from 1 to min_lr_ratio over the steps after warmup
  linear    a straight line from 1 to min_lr_ratio over the steps after warmup
  wsd       warmup-stable-decay: 1 until the last decay_fraction x D steps, then a straight line to
            min_lr_ratio (it can be extended before its decay starts: Hu et al. 2024, Hägele et al. 2024)
  constant  1
and min_lr_ratio after D (1 for constant). D (train.decay_steps 0) is train.steps of the run's first
launch, resolved into the run's config and so kept in its checkpoints: `fived train --resume DIR
--steps N` extends a run without moving the lr of any step it had planned (0 keeps the checkpoint's
D); `--train.decay_steps N` plans another decay on purpose (for wsd: before its decay starts).
"""

from __future__ import annotations

import math

from fived.config import TrainConfig


def decay_steps_of(t: TrainConfig) -> int:
    """The step the decay ends at: train.decay_steps, or (0) train.steps."""
    return t.decay_steps or t.steps


def wsd_decay_start(t: TrainConfig) -> int:
    """The first step (0-based) of warmup-stable-decay's decay: the last decay_fraction of D, after warmup."""
    decay_end = decay_steps_of(t)
    return max(t.warmup_steps, decay_end - max(1, round(t.decay_fraction * decay_end)))


def lr_multiplier(step: int, t: TrainConfig) -> float:
    """The lr of 0-based `step` (the step logged as step + 1), as a fraction of train.lr."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    floor = t.min_lr_ratio
    if decay_steps_of(t) <= t.warmup_steps:  # the decay ended within the warmup (a run shorter than it,
        return floor  # extended): its floor, not one step at the full lr first
    if t.lr_schedule == "wsd":
        start = wsd_decay_start(t)
        progress = min(max(step - start, 0) / max(decay_steps_of(t) - start, 1), 1.0)
        return floor + (1.0 - floor) * (1.0 - progress)
    progress = min((step - t.warmup_steps) / max(decay_steps_of(t) - t.warmup_steps, 1), 1.0)
    if t.lr_schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def describe_schedule(t: TrainConfig) -> str:
    """The plan in words, for the run's header line."""
    end = decay_steps_of(t)
    warmup = f"warmup {t.warmup_steps}, " if t.warmup_steps else ""
    if t.lr_schedule == "constant":
        return f"lr {t.lr:g} constant ({warmup.rstrip(', ') or 'no warmup'})"
    floor = f"{t.lr * t.min_lr_ratio:.3g}"
    if end <= t.warmup_steps < t.steps:  # (what lr_multiplier does then: warmup, then the floor)
        return f"lr {t.lr:g} ({warmup}past the {t.lr_schedule} decay's end at step {end}: {floor} from step {t.warmup_steps + 1})"
    if t.lr_schedule == "wsd":
        shape = f"wsd: stable to step {wsd_decay_start(t)}, decay over steps {wsd_decay_start(t) + 1}-{end}"
    else:
        shape = f"{t.lr_schedule} decay to step {end}"
    after = f"; steps after {end} at {floor}" if end < t.steps else ""
    return f"lr {t.lr:g} ({warmup}{shape}, to {floor}{after})"
