"""What `fived train` says about a launch, the same under both launchers (its own ranks or
torchrun's): a header before the first step, and at the end the run's figures — mean tokens/s, MFU
and step time over the launch's steps after the first few (which pay for allocation, compilation
and the first collectives' setup), the loss from its first to its last step, the wall time and the
checkpoints saved. `fived.train` (the Python API) returns the same figures as a `RunSummary`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fived.config import Config
from fived.layout.layout import resolve_dp
from fived.optim.lr_schedule import describe_schedule

WARMUP_STEPS_EXCLUDED = 3  # the first steps of a launch, left out of its means (at most all but one)


@dataclass
class RunSummary:
    """One launch of a training run, in figures (from rank 0's step records)."""

    output_dir: str
    first_step: int  # the first and last step this launch trained (1-based, as logged)
    last_step: int
    loss_first: float
    loss_last: float
    tokens_per_s: float  # over the counted steps: their tokens / their time
    mfu: float  # over the counted steps (the FLOPs of fived.layout.flops over their time)
    step_time_s: float  # mean over the counted steps
    counted_from: int  # the first step of the means (the steps before it are excluded)
    wall_s: float  # the launch, from its header to its end (starting ranks, loading, evaluations, saves)
    checkpoints: list[int] = field(default_factory=list)  # the steps saved by this launch
    val_loss: float | None = None  # the last validation loss, where train.eval_every logged one

    def lines(self) -> list[str]:
        """The launch's closing lines."""
        steps = self.last_step - self.first_step + 1
        counted = f"steps {self.counted_from}-{self.last_step}" + (
            f", the first {self.counted_from - self.first_step} excluded" if self.counted_from > self.first_step else ""
        )
        saved = (
            f"{len(self.checkpoints)} checkpoint(s) saved (steps {', '.join(map(str, self.checkpoints))}) in "
            f"{self.output_dir}/checkpoints"
            if self.checkpoints
            else "no checkpoint saved"
        )
        out = [
            f"fived train: {steps} step(s) ({self.first_step}-{self.last_step}) in {self.wall_s:.1f} s; loss "
            f"{self.loss_first:.4f} -> {self.loss_last:.4f}; {saved}",
            f"  mean over {counted}: {self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu:.1%}, "
            f"{self.step_time_s:.3g} s/step",
        ]
        if self.val_loss is not None:
            out.append(f"  val_loss {self.val_loss:.4f} (step {self.last_step})")
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def summarise(records: list[dict], output_dir: str, wall_s: float, checkpoints: list[int]) -> RunSummary:
    """The figures of a launch from its step records (metrics.jsonl's, this launch's steps)."""
    counted = records[min(WARMUP_STEPS_EXCLUDED, len(records) - 1) :]
    seconds = sum(r["step_time_s"] for r in counted)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in counted)  # (each step's global batch)
    mfu = sum(r["mfu"] * r["step_time_s"] for r in counted) / seconds  # (one step's FLOPs: mfu x time is fixed)
    evaluated = [r["val_loss"] for r in records if "val_loss" in r]
    return RunSummary(
        output_dir,
        records[0]["step"],
        records[-1]["step"],
        records[0]["loss"],
        records[-1]["loss"],
        tokens / seconds,
        mfu,
        seconds / len(counted),
        counted[0]["step"],
        wall_s,
        list(checkpoints),
        evaluated[-1] if evaluated else None,
    )


def header_lines(cfg: Config, world: int, launcher: str, resumed_step: int | None) -> list[str]:
    """What a launch says before its first step: the model, the ranks, the layout, the steps, where
    the metrics go, and the learning-rate plan."""
    p = cfg.parallel
    start = (
        f"resuming step {resumed_step} of {cfg.train.output_dir} to step {cfg.train.steps}"
        if resumed_step is not None
        else f"{cfg.train.steps} steps"
    )
    return [
        f"fived train: model {cfg.model.name}, {world} {launcher}, layout dp={resolve_dp(cfg, world)} tp={p.tp} pp={p.pp} cp={p.cp} "
        f"ep={p.ep} zero={p.zero}, {start} -> {cfg.train.output_dir}/metrics.jsonl",
        f"  {describe_schedule(cfg.train)}; {cfg.train.global_batch} x {cfg.train.seq_len} tokens per step, "
        f"{cfg.train.dtype}",
    ]
