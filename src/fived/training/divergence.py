"""The divergence guard: a run whose numbers go bad stops (or rolls back) before anything is lost.

After every step each rank checks the step's loss and gradient norm (the same all-reduced values on
every rank, so every rank reaches the same verdict at the same step): a non-finite loss or gradient
norm, or a loss above `train.spike_factor` x the median of the last `train.spike_window` losses,
is a divergence. The guard sees from the first step: before the window fills, the median of the
losses so far (a resumed run's are the checkpoint's own, saved with it), and before any, ln(vocab
size), the loss of a uniform guess, which no healthy step exceeds by the factor. The diverged step
is never logged or saved.

Which checkpoints are healthy: the checkpoint of step N holds the weights after N updates, and the
loss of those weights is first seen at step N+1. So a checkpoint is known healthy once the step after
it passed the guard; when step S diverges, the checkpoints of S-1 and later are suspect. They are set
aside (kept in `checkpoints/diverged-*`, never loaded or pruned), and pruning (fived.checkpoint.checkpointer)
only counts checkpoints whose next step passed.

`train.on_spike`:
  stop       the ranks raise `Diverged`; the launcher prints one line and exits DIVERGED_EXIT.
  rollback   every rank reloads the newest healthy checkpoint (step C, chosen by rank 0), skips the data windows of
             steps C+1..S (the sampler's `skips`), saves the checkpoint of step C again with the skip
             (replacing the reloaded one, so a crash and resume skips it too), truncates the metrics log to C,
             appends the event to `rollbacks.jsonl` and trains on; at most `train.max_rollbacks`
             times per launch, then it stops as above.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
import sys
import time
from pathlib import Path

from fived.checkpoint.checkpointer import complete_checkpoints
from fived.checkpoint.verify import cached_damage

DIVERGED_EXIT = 65  # the run's numbers went bad; nothing after the last healthy checkpoint was kept


class Diverged(RuntimeError):
    """Raised on every rank at the diverged step; `summary()` travels to the launcher."""

    def __init__(self, step: int, reason: str, healthy: str | None, run_dir: str, steps: int, lr: float):
        self.step, self.reason, self.healthy, self.run_dir = step, reason, healthy, run_dir
        lower = f"a lower --train.lr than {lr:g}"  # (the launch's own: it may have been overridden)
        if healthy:  # (--steps: the launch's target, which may have extended the run past the checkpoint's)
            then = (
                f"newest healthy checkpoint {healthy}; continue with: fived train --resume {run_dir} "
                f"--steps {steps} and {lower} (or --train.on_spike rollback)"
            )
        else:
            then = f"no healthy checkpoint to continue from; start again with {lower}"
        super().__init__(f"diverged at step {step}: {reason}; nothing saved after it; {then}")

    def summary(self) -> dict:
        return {"kind": "diverged", "step": self.step, "reason": self.reason, "line": str(self)}


class LossGuard:
    """The recent losses and the verdict on each step. A checkpoint component ("guard"): its recent
    losses are saved, so a resumed run checks its first steps against the losses before the save."""

    def __init__(self, factor: float, window: int, *, vocab_size: int = 0):
        self.factor, self.window = factor, window
        self.uniform = math.log(vocab_size) if vocab_size > 1 else 0.0  # the loss of a uniform guess
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.rollbacks = 0  # in this launch (not saved: a rollback must not restore its own count)

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """Why this step diverged, or None."""
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"the gradient norm is {grad_norm} (loss {loss:.4g})"
        if self.factor <= 0 or not (self.recent or self.uniform):
            return None
        if self.recent:
            median, of = statistics.median(self.recent), f"the median of the last {len(self.recent)} steps"
        else:  # (the first step of a run: no loss yet to compare with)
            median, of = self.uniform, "ln(vocab size), the loss of a uniform guess"
        if loss > self.factor * median:
            return f"loss {loss:.4g} > train.spike_factor={self.factor:g} x {median:.4g}, {of}"
        return None

    def accept(self, loss: float) -> None:
        self.recent.append(loss)

    def tensors(self, for_load: bool) -> dict:
        return {}

    def state(self) -> dict:
        return {"recent": list(self.recent)}

    def load_state(self, state: dict) -> None:
        self.recent = collections.deque((float(x) for x in state.get("recent", [])), maxlen=self.window)


def healthy_checkpoint(run_dir: str | Path, diverged_step: int) -> tuple[int, Path] | None:
    """(step, directory) of the newest intact checkpoint whose next step passed the guard (newest
    first: older ones are not verified once one is found)."""
    for step, path in reversed(complete_checkpoints(run_dir)):
        if step <= diverged_step - 2 and cached_damage(path) is None:
            return step, path
    return None


def agreed_healthy_checkpoint(run_dir: str | Path, diverged_step: int, group) -> tuple[int, Path] | None:
    """Every rank of `group`: rank 0's healthy_checkpoint(), broadcast. Only rank 0's view counts: its
    wait() covered a background save's finalisation (other ranks' may not have), and a transient
    read error on another rank must not send that rank to an older checkpoint."""
    import torch.distributed as dist

    choice = [healthy_checkpoint(run_dir, diverged_step) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0, group=group)
    return choice[0]


def record_rollback(run_dir: str | Path, event: dict) -> None:
    """Rank 0: one line on stderr and one JSON line in rollbacks.jsonl."""
    print(
        f"\nfived train: rolled back: step {event['diverged_step']} diverged ({event['reason']}); "
        f"reloaded checkpoint step-{event['from_step']} and skipped the data of steps "
        f"{event['from_step'] + 1}..{event['diverged_step']} (rollback {event['rollback']} of "
        f"{event['max_rollbacks']})",
        file=sys.stderr,
        flush=True,
    )
    from fived.files import append_line

    append_line(run_dir, "rollbacks.jsonl", json.dumps({"time": time.time(), **event}))


def handle_divergence(trainer, done: int, reason: str) -> int:
    """Every rank, when step `done` (1-based) failed the guard: set the suspect checkpoints aside,
    then raise Diverged, or roll back and return the step to train next."""
    import torch.distributed as dist

    from fived.training.metrics import MetricsLog, keep_log_until

    t, checkpointer = trainer.cfg.train, trainer.checkpointer
    if checkpointer is None:  # (a run that owns no directory: nothing saved, nothing to roll back to)
        raise Diverged(done, reason, None, t.output_dir, t.steps, t.lr)
    checkpointer.wait()  # (a background save in flight is of an earlier step: let it land first)
    healthy = agreed_healthy_checkpoint(t.output_dir, done, checkpointer.group)  # (before the suspects move)
    if trainer.rank == 0:
        checkpointer.supersede_after(healthy[0] if healthy else 0, why="diverged")
    dist.barrier(group=checkpointer.group)
    if t.on_spike != "rollback" or healthy is None or trainer.guard.rollbacks >= t.max_rollbacks:
        if t.on_spike == "rollback" and healthy is not None:
            reason += f" (after {trainer.guard.rollbacks} rollbacks, train.max_rollbacks)"
        raise Diverged(done, reason, str(healthy[1]) if healthy else None, t.output_dir, t.steps, t.lr)
    step, path = healthy
    rollbacks = trainer.guard.rollbacks + 1
    skips = trainer.sampler.skips  # (this launch's earlier rollbacks included: each skips further)
    checkpointer.load(path)  # every component: weights, Adam, schedule, sampler, guard
    checkpointer.last_step = step
    trainer.guard.rollbacks = rollbacks
    trainer.sampler.skips = [*skips, *(s for s in trainer.sampler.skips if s not in skips)]
    trainer.sampler.skip(step, done - step)
    # The skip must outlive this process: a crash before the next periodic save would resume the
    # checkpoint of `step` without it and train on the window that diverged. Saved again, with it.
    checkpointer.save(step, replace=True)
    if trainer.log is not None:  # (the log's file is replaced: reopen it)
        trainer.log.close()
        keep_log_until(t.output_dir, step)
        trainer.log = MetricsLog(t.output_dir, t.tensorboard, trainer.tracker)
        record_rollback(
            t.output_dir,
            {
                "diverged_step": done,
                "reason": reason,
                "from_step": step,
                "skipped_steps": [step + 1, done],
                "rollback": rollbacks,
                "max_rollbacks": t.max_rollbacks,
            },
        )
    return step
