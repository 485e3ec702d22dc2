"""Pipeline parallelism: the model split by depth into pp x pp_virtual stages, run by the schedules
of `torch.distributed.pipelining`, with every executed action recorded.

- Stages: contiguous layers, balanced by cost (a layer's FLOPs per token; the output head counts on
  the last stage), or as `parallel.pp_layers` says ("3,1,2,2"). The embedding lives on the first
  stage, the final norm, head and loss on the last. Stage s runs on pp rank s % pp for looped
  schedules, and on ranks 0..pp-1 then back pp-1..0 for the V-shaped ones (zbv, dualpipev).
- The loss of a micro-batch is its summed cross-entropy over the *global* batch's token count, and
  the schedules do not rescale gradients (scale_grads=False): every schedule gives the same gradients.
- Each rank records what it executed — F (forward), B (full backward), I (backward for inputs),
  W (backward for weights), and the send/recv it issued — with stage, micro-batch and time.
  `fived.layout.schedule_sim` costs such action lists with unit times to give the bubble.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from fived.config import Config, ModelConfig
from fived.layout.layout import SINGLE_STAGE, stages_per_rank
from fived.layout.stages import split_layers, stage_rank
from fived.model.transformer import Transformer, build_model
from fived.parallel import comm
from fived.parallel.tensor_overlap import backward_pass


def build_stage(cfg: ModelConfig, layers: list[int], first: bool, last: bool, dtype: torch.dtype) -> Transformer:
    """A meta-device Transformer holding only `layers` (names kept), the embedding if first, and
    the final norm and head if last."""
    model = build_model(cfg, "meta", dtype)
    for name in [n for n in model.layers if int(n) not in layers]:
        del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm, model.output, model.mtp = None, None, None
    return model


@dataclass
class Action:
    rank: int
    kind: str  # F, B, I, W, send_f, recv_f, send_b, recv_b
    stage: int
    microbatch: int
    start: float
    end: float


@dataclass
class Timeline:
    """What one rank executed, in order. The point-to-point ops the stages build are counted by
    `fived.parallel.comm` (the schedule issues them). `spans`: the trainer's `fived.training.step_timer.StepTimer`, if
    it times the step: each forward and backward is a span of its stage and micro-batch."""

    actions: list[Action] = field(default_factory=list)
    spans: object = None

    def record(self, stage, kind: str, fn):
        rank = torch.distributed.get_rank()
        category = {"F": "forward", "B?": "backward", "W": "backward"}.get(kind)

        def run(chunk_id, *args, **kwargs):
            start = time.perf_counter()
            if category is None:  # send/recv ops: counted as built (labelled when profiling)
                with _posting(self.spans, kind):
                    out = fn(chunk_id, *args, **kwargs)
                comm.note_point_to_point(out)
            elif self.spans is None:
                out = fn(chunk_id, *args, **kwargs)
            else:
                with self.spans.span(category, stage=stage.stage_index, micro=chunk_id):
                    out = fn(chunk_id, *args, **kwargs)
            k = kind if kind != "B?" else ("B" if kwargs.get("full_backward", True) else "I")
            self.actions.append(Action(rank, k, stage.stage_index, chunk_id, start, time.perf_counter()))
            return out

        return run

    def instrument(self, stage) -> None:
        stage.forward_one_chunk = self.record(stage, "F", stage.forward_one_chunk)
        stage.backward_one_chunk = self.record(stage, "B?", stage.backward_one_chunk)
        stage.backward_weight_one_chunk = self.record(stage, "W", stage.backward_weight_one_chunk)
        for kind in ("fwd_send", "fwd_recv", "bwd_send", "bwd_recv"):
            name = f"get_{kind}_ops"
            label = {"fwd_send": "send_f", "fwd_recv": "recv_f", "bwd_send": "send_b", "bwd_recv": "recv_b"}[kind]
            setattr(stage, name, self.record(stage, label, getattr(stage, name)))


def _tell_backward(stage, on_backward) -> None:
    """Wrap the one method every backward pass of a torch PipelineStage goes through (its hook for
    DDP/FSDP: full, input-only and weight-only passes, with the schedule's last_backward flag)."""
    original = stage.backward_maybe_with_nosync

    def run(backward_type, bwd_kwargs, last_backward=False):
        weights = backward_type in ("full", "weight")
        on_backward(last=last_backward, weights=weights)
        try:
            with backward_pass(backward_type):  # (overlapped tp regions compute what this pass wants)
                return original(backward_type, bwd_kwargs, last_backward=last_backward)
        finally:
            on_backward(last=last_backward, weights=weights, stage=stage.submod)

    stage.backward_maybe_with_nosync = run


def _posting(spans, kind: str):
    """While profiling, the pipeline's point-to-point ops named by mesh dimension as they are built."""
    if spans is None or not spans.profiling:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"fived/comm/pp/{kind}")


class Pipeline:
    """The stages of this pp rank and the schedule that runs them."""

    def __init__(self, cfg: Config, mesh):
        p = mesh.layout
        self.cfg, self.mesh, self.schedule_name = cfg, mesh, p.pp_schedule
        self.n_stages = p.pp * stages_per_rank(p.pp_schedule, p.pp_virtual)
        self.layers = split_layers(cfg.model, self.n_stages, p.pp_layers)
        rank = mesh.rank("pp")
        self.stage_ids = [s for s in range(self.n_stages) if stage_rank(s, p.pp, p.pp_schedule) == rank]
        self.timeline = Timeline()

    def build_chunks(self, dtype: torch.dtype) -> list[Transformer]:
        return [
            build_stage(self.cfg.model, self.layers[s], s == 0, s == self.n_stages - 1, dtype) for s in self.stage_ids
        ]

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def build_schedule(self, modules: list[nn.Module], loss_fn, device: torch.device, *, on_backward=None):
        """`on_backward(last=, weights=, stage=)`: told before (stage None) and after each backward
        pass of a stage, whether it is the stage's last micro-batch and produces weight gradients
        (the data-parallel strategy starts reducing a stage's gradients after its last one)."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as S

        group = self.mesh.group("pp")
        stages = [PipelineStage(m, s, self.n_stages, device, group=group) for m, s in zip(modules, self.stage_ids)]
        for stage in stages:
            self.timeline.instrument(stage)
            if on_backward is not None:
                _tell_backward(stage, on_backward)
        cls = {
            "gpipe": S.ScheduleGPipe,
            "1f1b": S.Schedule1F1B,
            "interleaved-1f1b": S.ScheduleInterleaved1F1B,
            "zero-bubble": S.ScheduleInterleavedZeroBubble,
            "zbv": S.ScheduleZBVZeroBubble,
            "dualpipev": S.ScheduleDualPipeV,
        }[self.schedule_name]
        micro = self.cfg.train.microbatches
        if self.schedule_name in SINGLE_STAGE:
            self.schedule = cls(stages[0], n_microbatches=micro, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = cls(stages, n_microbatches=micro, loss_fn=loss_fn, scale_grads=False)
        return self.schedule

    def last_step_actions(self) -> list[Action]:
        """The actions of the last schedule.step."""
        return list(self.timeline.actions)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, extra: dict | None = None) -> torch.Tensor:
        """Run every micro-batch through the schedule; return the sum of the micro-batch losses on
        the last stage (zero elsewhere). `extra`: the model's keyword inputs (per row: documents,
        positions), given to every stage, each micro-batch its rows (the schedule splits them)."""
        losses: list[torch.Tensor] = []
        first = 0 in self.stage_ids
        self.timeline.actions.clear()  # keep the last step's actions only
        self.schedule.step(  # (return_outputs: else the last stage keeps every micro-batch's logits, then merges them)
            inputs if first else None,
            target=targets if self.has_last_stage else None,
            losses=losses,
            return_outputs=False,
            **(extra or {}),
        )
        total = torch.zeros((), dtype=torch.float64, device=inputs.device)
        for loss in losses:
            total += loss.detach().double()
        return total

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, extra: dict | None = None) -> torch.Tensor:
        """Forward only, through the schedule's eval path: the summed micro-batch losses on the last
        stage (zero elsewhere). The timeline keeps the last training step's actions."""
        kept = list(self.timeline.actions)
        # The schedules that run an action list (interleaved, zero-bubble, V-shaped) would still run its
        # backward actions in eval: give them the list without those (forwards keep their order).
        order = getattr(self.schedule, "pipeline_order_with_comms", None)
        if order is not None:
            self.schedule.pipeline_order_with_comms = {rank: forward_only(actions) for rank, actions in order.items()}
        losses: list[torch.Tensor] = []
        try:
            self.schedule.eval(  # (return_outputs reaches step: as in training, no logits kept)
                inputs if 0 in self.stage_ids else None,
                target=targets if self.has_last_stage else None,
                losses=losses,
                return_outputs=False,
                **(extra or {}),
            )
        finally:
            if order is not None:
                self.schedule.pipeline_order_with_comms = order
            self.timeline.actions[:] = kept
        total = torch.zeros((), dtype=torch.float64, device=inputs.device)
        for loss in losses:
            total += loss.detach().double()
        return total


def forward_only(actions: list) -> list:
    """A schedule's action list without its backward work: forwards, their sends and receives, in
    order (an overlapped forward-backward pair keeps its forward)."""
    from torch.distributed.pipelining import schedules as S

    kept = []
    for action in actions:
        if action is None:
            continue
        if action.computation_type in (S.FORWARD, S.SEND_F, S.RECV_F, S.UNSHARD, S.RESHARD):
            kept.append(action)
        elif action.sub_actions:
            kept.extend(forward_only(list(action.sub_actions)))
    return kept


def write_chrome_trace(path: str, actions: list[Action]) -> None:
    """Chrome / Perfetto trace: one process per rank, one thread per stage, times in microseconds
    from the earliest action (fived.files: never over a file fived did not write, never through a link)."""
    import json

    from fived.files import write_output

    t0 = min((a.start for a in actions), default=0.0)
    events = [
        {
            "name": f"{a.kind}{a.microbatch}",
            "cat": a.kind,
            "ph": "X",
            "pid": a.rank,
            "tid": a.stage,
            "ts": (a.start - t0) * 1e6,
            "dur": max((a.end - a.start) * 1e6, 0.001),
            "args": {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind},
        }
        for a in actions
    ]
    events += [
        {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
        for r in sorted({a.rank for a in actions})
    ]
    trace = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
    write_output(path, trace, "train.trace", ours=None)  # (each launch's trace is kept, as its profile)
