"""The trainer: one rank's view of a training run. Runs the same on 1 rank or N, CPU or CUDA.

Per step: fetch this dp rank's slice of the global batch, run the micro-batches (loss of each is its
token-sum of cross-entropy divided by the *global* batch's token count, so gradients add up to the
gradient of the mean loss over all tokens whatever the layout), finish gradient reduction once,
clip by the global norm, step AdamW and the schedule, and log.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from fived.checkpoint.checkpointer import Checkpointer
from fived.compat import schedule_stages
from fived.config import Config
from fived.data.documents import RankBatches, split_micro_batches
from fived.data.loader import GlobalBatchSampler, check_data, end_of_document_id, validation_sampler
from fived.layout.flops import flops_per_token
from fived.layout.rules import check_config
from fived.model.ledger import ActivationLedger, model_state_bytes
from fived.model.mtp import mtp_target_counts
from fived.model.transformer import MoE, canonical_name
from fived.optim.adamw import build_scheduler
from fived.parallel.mesh import PRECISIONS, build_dtype
from fived.parallel.process_group import device_type
from fived.parallel.rank import build_rank
from fived.planner.hardware import device_peak_tflops
from fived.training.divergence import LossGuard, handle_divergence
from fived.training.faults import PreemptionRequest, timeouts_named
from fived.training.metrics import MetricsLog, keep_log_until, peak_memory_mb
from fived.training.profiling import ProfileWindow
from fived.training.source_losses import SourceLosses
from fived.training.state import ModelState, OptimizerState, ProgressState, RNGState
from fived.training.step_timer import StepTimer
from fived.training.tracker import Tracker, open_tracker

# The host's measured matmul rate, once per process and dtype (about a second in bf16 on a CPU): later
# runs in the process, and ranks forked from it after it was read, share the reading.
host_peak_tflops = functools.cache(device_peak_tflops)


def shared_peak_tflops(dtype: torch.dtype, configured: float, device: torch.device, rank: int, world: int) -> float:
    """`host_peak_tflops` for MFU, the same on every rank: CPU ranks share a host, so rank 0 times the
    matmul (a second of one core per rank otherwise, while the others time theirs) and broadcasts it."""
    if device.type != "cpu" or world == 1 or configured > 0 or not dist.is_initialized():
        return host_peak_tflops(dtype, configured, device.type)
    value = torch.tensor([host_peak_tflops(dtype, configured, "cpu") if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(value, src=0)
    return float(value.item())


@dataclass
class TrainResult:
    metrics: list[dict]
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # full parameters, if asked for
    memory: dict[str, int] = field(default_factory=dict)  # this rank's model-state bytes
    comm: dict[str, dict[str, int]] = field(default_factory=dict)  # last step's collectives
    # bytes saved for backward per micro-batch: per layer id, "embedding" and "head" where this rank has them
    activations: dict[str, int] = field(default_factory=dict)
    timeline: list = field(default_factory=list)  # pipeline actions this rank executed (last step)
    expert_load: dict[str, list[float]] = field(
        default_factory=dict
    )  # MoE layer id -> global tokens per expert (last step)
    breakdowns: list[dict] = field(default_factory=list)  # this rank's measured step breakdown per step
    preempted: bool = False  # stopped early on SIGTERM (after saving, when checkpointing is on)
    checkpoints: list[int] = field(default_factory=list)  # the steps this launch saved checkpoints of


class Trainer:
    """`log`: this run owns cfg.train.output_dir (metrics, checkpoints); `resume`: a checkpoint to
    continue from (written by any layout)."""

    def __init__(
        self, cfg: Config, log: bool = True, resume: str | None = None, preemption: PreemptionRequest | None = None
    ):
        self.cfg = cfg
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        check_config(cfg, self.world)  # already checked before launch; a cheap guard under torchrun
        built = build_rank(
            cfg, self.world, device=device_type(cfg.train.device), timeout_s=cfg.train.collective_timeout_s
        )
        self.mesh = built.mesh
        self.checkpointer: Checkpointer | None = None
        try:
            self._set_up(built, log, resume, preemption)
        except BaseException:
            self.close()  # (a run that fails to start gives back its groups too)
            raise

    def _set_up(self, built, log: bool, resume: str | None, preemption: PreemptionRequest | None) -> None:
        cfg = self.cfg
        self.device, self.pipeline, self.plan = built.device, built.pipeline, built.plan
        chunks, modules, self.optimizer = built.chunks, built.modules, built.optimizer
        t = cfg.train
        self.precision = PRECISIONS[t.dtype]
        self._find_moe_layers(chunks)
        # this rank's tokens of a batch (context parallelism) and, with document masking, their documents
        self.batches = RankBatches(
            end_of_document=end_of_document_id(cfg) if cfg.data.document_mask else None,
            cp=self.mesh.cp,
            cp_rank=self.mesh.rank("cp"),
            balance=cfg.parallel.cp_balance,
            fixed_positions=self.plan.positions,
            mtp_depth=cfg.model.mtp_depth,
        )
        self.dp = self.plan.data_parallel
        self.init_stats = built.init_stats  # this rank's generator work: its share of the model (+ tile edges)
        self.model = modules[0]
        # Bytes saved for backward per micro-batch, measured on the first step: its first micro-batch,
        # or under a pipeline schedule every micro-batch it runs (mean), over all of this rank's chunks.
        self.activations = ActivationLedger(chunks)
        # Where each step's time goes (and the bytes of every collective fived issues)
        self.timer = StepTimer(self.device, self.mesh.group_names(), enabled=t.breakdown)
        self.timer.watch_recompute(chunks if not t.compile else [])  # (compiled blocks: not timed apart)
        if self.pipeline:
            self.pipeline.timeline.spans = self.timer if t.breakdown else None
            schedule = self.pipeline.build_schedule(
                modules, self._pipeline_loss, self.device, on_backward=self.dp.backward_of_stage
            )
            self.activations.watch_stages(schedule_stages(schedule))
        self.scheduler = build_scheduler(self.optimizer, t)
        if t.init_from and not resume:  # (a resumed run's checkpoint holds the weights)
            self._init_from(chunks)

        self.sampler = GlobalBatchSampler(check_data(cfg), t.seq_len, t.global_batch, t.seed)
        self.source_losses = SourceLosses(self.sampler.sources)  # (a blend's per-source losses)
        self.global_tokens = t.global_batch * t.seq_len
        self.val_sampler, self.val_batches = validation_sampler(cfg)
        self.loss_divisor = self.global_tokens  # what a pipeline micro-batch's loss is divided by (1 in eval)
        self.profile = ProfileWindow(t.profile, t.steps, t.output_dir, self.rank, self.device, self.timer)
        self.state_bytes: dict[str, int] = {}
        self.peak_flops = shared_peak_tflops(build_dtype(cfg), t.peak_tflops, self.device, self.rank, self.world) * 1e12
        self.flops_per_step = flops_per_token(cfg.model, t.seq_len) * self.global_tokens
        self.guard = LossGuard(
            t.spike_factor, t.spike_window, vocab_size=cfg.model.vocab_size
        )  # (a checkpoint component: before the load)
        self.checkpointer = self._open_checkpoints(chunks, log, resume)
        if log and self.rank == 0:
            keep_log_until(t.output_dir, self.sampler.step)  # a resumed run rewrites nothing twice
        self.tracker = open_tracker(cfg, self.world) if (log and self.rank == 0) else Tracker()
        self.log = MetricsLog(t.output_dir, t.tensorboard, self.tracker) if (log and self.rank == 0) else None
        self.preemption, self.preempted = preemption or PreemptionRequest(), False
        self.saved_steps: list[int] = []

    def close(self) -> None:
        """Give back the process groups this run created (its mesh's, its checkpointer's); the default
        group is the launcher's. Every rank calls it as its run ends, however it ends."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.mesh.close()

    def _find_moe_layers(self, chunks) -> None:
        self.moe_layers = [m for c in chunks for m in c.modules() if isinstance(m, MoE)]
        self.moe_layer_ids = [
            name for c in chunks for name, block in _named_blocks(c) if any(isinstance(m, MoE) for m in block.modules())
        ]  # (in moe_layers' order)
        self.mtp_heads = [c.mtp for c in chunks if c.mtp is not None and c.output is not None]
        self.last_expert_load: torch.Tensor | None = None  # [local MoE layer, expert], the last step's

    def expert_load(self) -> dict[str, list[float]]:
        """MoE layer id -> the last step's global tokens per expert (this rank's layers)."""
        if self.last_expert_load is None:
            return {}
        return {lid: row.tolist() for lid, row in zip(self.moe_layer_ids, self.last_expert_load.double())}

    def _open_checkpoints(self, chunks, log: bool, resume: str | None) -> Checkpointer | None:
        """The run's checkpointer (when it owns a run directory or resumes), with `resume` loaded."""
        if not (log or resume):
            return None
        t = self.cfg.train
        checkpointer = Checkpointer(
            t.output_dir, self.cfg.checkpoint, self._stateful(chunks), self._manifest(), t.collective_timeout_s
        )
        if resume:
            checkpointer.last_step = checkpointer.load(resume)["step"]
            checkpointer.origin = Path(resume).resolve()
            if log and self.rank == 0:
                checkpointer.supersede_after(checkpointer.last_step)
        return checkpointer

    def _init_from(self, chunks) -> None:
        """--init-from: the weights from a Hugging Face directory or a fived checkpoint, filled in by
        placement as a resume fills them (into the float32 masters in bf16 runs, then the model)."""
        from fived.hf.init import load_initial_weights

        model_state = ModelState(self.plan, chunks)
        buffers = {canonical_name(raw) for chunk in chunks for raw, _ in chunk.named_buffers()}
        load_initial_weights(self.cfg.train.init_from, model_state.tensors(for_load=True), buffers)
        model_state.load_state({})

    def _stateful(self, chunks) -> dict:
        """The components a checkpoint holds, by name."""
        return {
            "model": ModelState(self.plan, chunks),
            "optimizer": OptimizerState(self.plan, self.optimizer),
            "progress": ProgressState(self.sampler, self.scheduler),
            "rng": RNGState(),
            "guard": self.guard,
        }

    def _manifest(self) -> dict:
        m = self.mesh
        return {
            "config": self.cfg.to_dict(),
            "world_size": self.world,
            "layout": {
                "dp": m.dp,
                "tp": m.tp,
                "pp": m.pp,
                "cp": m.cp,
                "ep": m.ep,
                "dp_replicate": m.dp_replicate,
                "zero": self.cfg.parallel.zero,
                "pp_schedule": self.cfg.parallel.pp_schedule,
            },
        }

    def _autocast(self):
        if self.precision.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            loss = self.source_losses.loss_sum(self.plan, logits, targets) / self.loss_divisor
        self.activations.leave()  # the head's part of this micro-batch ends with its loss
        return loss

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, extra: dict) -> torch.Tensor:
        """Every micro-batch of this rank's batch (`extra`: the model's keyword inputs, per row);
        returns the summed token cross-entropy."""
        if self.pipeline:
            self.dp.before_micro_batch(is_last=True)
            if not self.activations.per_layer:
                self.activations.start()
            if self.plan.mtp_link is not None:  # (the last stage's copy of the embedding: this step's weights)
                self.plan.mtp_link.sync_weights()
            with self.timer.span("bubble"), self._autocast(), self.plan.forward_context(self.activations):
                loss_sum = self.pipeline.step(inputs, targets, extra) * self.global_tokens
            if self.activations.recording:
                self.activations.stop()
            return loss_sum
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        micro_batches = split_micro_batches(inputs, targets, extra, self.cfg.train.microbatches)
        for i, (micro, micro_targets, micro_extra) in enumerate(micro_batches):
            self.dp.before_micro_batch(is_last=i == len(micro_batches) - 1)
            if i == 0 and not self.activations.per_layer:
                self.activations.start()
            with self.timer.span("forward", micro=i), self._autocast(), self.plan.forward_context(self.activations):
                logits = self.model(micro, **micro_extra)
                loss = self.source_losses.loss_sum(self.plan, logits, micro_targets)
                del logits  # (autograd keeps the log-probabilities, not these: their [tokens, vocab] freed now)
                self.activations.leave()
            if self.activations.recording:
                self.activations.stop()
            with self.timer.span("backward", micro=i):
                (loss / self.global_tokens).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean cross-entropy over every token of the validation batches, forward only. Uses no
        random numbers and no training data position, so a run with evaluations trains bit-for-bit
        like one without."""
        self.dp.wait_parameters()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        micro = self.cfg.train.microbatches
        assert self.val_sampler is not None  # (evaluations need validation data: checked before launch)
        for index in range(self.val_batches):
            inputs, targets, extra = self.batches(
                self.val_sampler.local_batch_at(index, self.mesh.rank("dp"), self.mesh.dp).to(self.device)
            )
            if self.pipeline:
                with self._autocast(), self._summed_losses():
                    loss_sum += self.pipeline.evaluate(inputs, targets, extra)
                continue
            for micro_inputs, micro_targets, micro_extra in split_micro_batches(inputs, targets, extra, micro):
                with self._autocast():
                    loss_sum += self.plan.loss_sum(self.model(micro_inputs, **micro_extra), micro_targets).double()
        self.dp.after_forward_only()
        dist.all_reduce(loss_sum, group=self.mesh.group("dp_cp"))  # (as the training loss: see _step)
        if self.pipeline:
            dist.all_reduce(loss_sum, group=self.mesh.group("pp"))
        return loss_sum.item() / (self.val_batches * self.global_tokens)

    @contextlib.contextmanager
    def _summed_losses(self):
        """Pipeline micro-batch losses undivided (an evaluation sums them), then as in training."""
        self.loss_divisor = 1
        try:
            yield
        finally:
            self.loss_divisor = self.global_tokens

    def _read_moe_statistics(self):
        """The step's auxiliary loss (summed) and tokens per expert (per local MoE layer)."""
        aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        loads = []
        for moe in self.moe_layers:
            # One entry per micro-batch's backward; a pipeline schedule's first step also runs a
            # shape-inference backward on dummy data first, which is not a training value.
            entries = moe.aux_losses[-self.cfg.train.microbatches :]
            aux_sum += sum(aux.double() for aux, _ in entries)
            loads.append(sum(load for _, load in entries))
            moe.aux_losses.clear()
        return aux_sum, loads

    def _read_mtp_losses(self) -> torch.Tensor:
        """This rank's part of each MTP depth's mean cross-entropy this step (zero off the last stage)."""
        m = self.cfg.model
        out = torch.zeros(m.mtp_depth, dtype=torch.float64, device=self.device)
        for mtp in self.mtp_heads:
            for losses in mtp.losses[-self.cfg.train.microbatches :]:  # (as the aux loss: see above)
                out += losses.double()
            mtp.losses.clear()
        counts = mtp_target_counts(m, self.cfg.train.global_batch, self.cfg.train.seq_len)
        return out / torch.tensor(counts, dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def _balance_experts(self, loads: list[torch.Tensor]) -> float:
        """Global tokens per expert of each local MoE layer (summed over dp*cp, and tp when folded); with
        model.router_bias_rate > 0, step each router bias toward balance (DeepSeek-V3's
        aux-loss-free method: underloaded experts up, overloaded down). Returns the worst layer's
        max/mean load (over the whole pipeline)."""
        worst = torch.zeros((), dtype=torch.float64, device=self.device)
        if loads:
            stacked = torch.stack(loads)
            dist.all_reduce(stacked, group=self.mesh.group("dp_cp"))
            if self.mesh.layout.folded:  # (each tp rank routed its own sequence shard: parallel.etp=1)
                dist.all_reduce(stacked, group=self.mesh.group("tp"))
            rate = self.cfg.model.router_bias_rate
            for moe, load in zip(self.moe_layers, stacked):
                if rate > 0:
                    moe.router_bias += rate * torch.sign(load.mean() - load).to(moe.router_bias.dtype)
            worst = (stacked.amax(dim=1) / stacked.mean(dim=1).clamp_min(1e-9)).max()
            self.last_expert_load = stacked  # (read once, by expert_load(), at the end)
        if self.pipeline:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.mesh.group("pp"))
        return worst.item()

    def step(self, step: int) -> dict:
        """One optimizer step; a collective that times out is reported as a CollectiveTimeout."""
        with timeouts_named(self.rank, self.cfg.train.collective_timeout_s, self.timer.recorder.blamed_collective):
            self.profile.before_step(step)
            record = self._step(step)
            self.profile.after_step(step)
            return record

    def _stop_requested(self) -> bool:
        """Whether any rank got SIGTERM (every rank asks, at the same step boundary)."""
        everyone = ("all_reduce (the step-boundary stop flag)", "world", tuple(range(self.world)))
        with timeouts_named(self.rank, self.cfg.train.collective_timeout_s, lambda: everyone):
            return self.preemption.agreed(self.device)

    def _save(self, step: int, background: bool = False) -> bool:
        everyone = ("checkpoint save (DCP)", "checkpoint", tuple(range(self.world)))
        checkpointer = self.checkpointer
        assert checkpointer is not None  # (a run that saves owns a run directory or resumes)
        with timeouts_named(self.rank, checkpointer.timeout_s, lambda: everyone):
            saved = checkpointer.save(step, background)
        if saved:
            self.saved_steps.append(step)
        return saved

    def _step(self, step: int) -> dict:
        t = self.cfg.train
        start = time.perf_counter()
        self.source_losses.start()
        with self.timer.step(unrouted=self.dp.unrouted_collectives()):
            with self.timer.span("data"):
                inputs, targets, extra = self.batches(
                    self.sampler.local_batch_at(step, self.mesh.rank("dp"), self.mesh.dp).to(self.device)
                )
            loss_sum = self._forward_backward(inputs, targets, extra)
            with self.timer.span("optimizer"):
                aux_sum, loads = self._read_moe_statistics()
                self.plan.finish_gradients()
                grad_norm = self.plan.clip_gradients(t.grad_clip)
                self.dp.step()
                lr = self.scheduler.get_last_lr()[0]
                self.scheduler.step()
                if not self.state_bytes:  # once, while gradients and optimizer state both exist
                    self.state_bytes = model_state_bytes(self.dp.tensors())
                self.dp.zero_grad()
            # Logged loss: the mean over every token of the global batch; pipeline stages other than the
            # last contribute zero. (Not through fived.parallel.comm: 16 bytes of logging, not the step's
            # traffic; a blend adds its per-source sums.)
            with self.timer.span("logging"):
                by_source = self.source_losses.sums(
                    self.sampler.local_sources_at(step, self.mesh.rank("dp"), self.mesh.dp), t.microbatches, self.device
                )
                totals = torch.cat([torch.stack([loss_sum, aux_sum]), self._read_mtp_losses(), by_source])
                dist.all_reduce(totals, group=self.mesh.group("dp_cp"))
                if self.pipeline:
                    dist.all_reduce(totals, group=self.mesh.group("pp"))
                imbalance = self._balance_experts(loads) if self.cfg.model.is_moe else 0.0
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        record: dict = {
            "step": step + 1,
            "loss": totals[0].item() / self.global_tokens,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": self.global_tokens / elapsed,
            "mfu": self.flops_per_step / elapsed / (self.peak_flops * self.world) if self.peak_flops else 0.0,
            "peak_mem_mb": peak_memory_mb(self.device),
            "step_time_s": elapsed,
        }
        depth = self.cfg.model.mtp_depth
        if depth:  # the depths' mean cross-entropy (unweighted)
            record["mtp_loss"] = totals[2 : 2 + depth].mean().item()
        record.update(self.source_losses.record(totals[2 + depth :], self.sampler.global_sources_at(step), t.seq_len))
        record.update(self.batches.work_spread())  # (document masking under cp: the assignment's balance)
        if self.timer.enabled:
            record["breakdown"] = self.timer.breakdown()
        if self.cfg.model.is_moe:  # (every cp rank computed each of its sequences' whole statistic)
            record["aux_loss"] = totals[1].item() / t.global_batch / self.mesh.cp
            record["expert_load_max_over_mean"] = imbalance
        return record

    def fit(self, progress: bool = True, until: int | None = None) -> list[dict]:
        """Train from the sampler's step to `until` (default: train.steps) steps done."""
        from tqdm import tqdm

        last = until or self.cfg.train.steps
        step = first = self.sampler.step
        bar = tqdm(
            total=last,
            initial=first,
            desc="train",
            unit="step",
            disable=not (progress and self.rank == 0),
            mininterval=0.5,
        )
        history: list[dict] = []
        self.waited: float | None = None
        self.shown: dict[str, str] = {}
        while step < last:
            record = self.step(step)
            problem = self.guard.verdict(record["loss"], record["grad_norm"])
            if problem is not None:  # never logged, never saved; stop, or train on from a healthy step
                step = handle_divergence(self, step + 1, problem)
                history = [r for r in history if r["step"] <= step]
                bar.n = step
                continue
            self.guard.accept(record["loss"])
            self.sampler.step = step + 1
            self._after_step(step, record, first_step=step == first)
            history.append(record)
            if self.log is not None:  # (before the save: a checkpoint of step N implies its log)
                self.log.write(record)
            if self.checkpointer is not None and self._stop_requested():
                self.preempted = True  # every rank stops here, and saves this step below
                last = step + 1
                break
            if self.checkpointer is not None and self.checkpointer.due(step + 1) and step + 1 < last:
                start = time.perf_counter()
                with self.timer.span("checkpoint"):  # (the next step's record counts this stall)
                    self._save(step + 1, background=self.cfg.checkpoint.async_)
                self.waited = time.perf_counter() - start
            step += 1
            bar.update(1)
            if (step - 1) % self.cfg.train.log_every == 0 or step == last:
                bar.set_postfix(
                    loss=f"{record['loss']:.4f}",
                    lr=f"{record['lr']:.2e}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                    mfu=f"{record['mfu']:.1%}",
                    **self.shown,
                )
        self.profile.after_step(last - 1, last=True)  # (a run stopped inside the window writes what it has)
        if self.checkpointer is not None:
            final = self.cfg.checkpoint.final or self.checkpointer.due(last) or self.preempted
            if final and self.checkpointer.last_step != last and not self._save(last) and not self.preempted:
                raise self.checkpointer.final_save_skipped(last)  # (every rank: they agreed on the room)
            self.checkpointer.wait()
        if self.log is not None:
            self.log.close()
        self.tracker.close()
        return history

    def result(self, metrics: list[dict], *, return_state: bool = False) -> TrainResult:
        """What this rank measured over `metrics`' steps (and, if asked, the whole parameters)."""
        self.dp.wait_parameters()
        return TrainResult(
            metrics=metrics,
            state=self.plan.full_state() if return_state else {},
            memory=self.state_bytes,
            activations=self.activations.per_layer,
            comm=self.timer.recorder.summary(),
            timeline=self.pipeline.last_step_actions() if self.pipeline else [],
            preempted=self.preempted,
            expert_load=self.expert_load(),
            breakdowns=[m["breakdown"] for m in metrics if "breakdown" in m],
            checkpoints=list(self.saved_steps),
        )

    def _after_step(self, step: int, record: dict, first_step: bool) -> None:
        """What a healthy step adds to its record: the wait for the previous save, the background
        saves' staging (after the first step: the optimizer's moments exist), an evaluation."""
        if self.waited is not None:  # how long training waited for the save after the previous step
            record["checkpoint_s"], self.waited = self.waited, None
            if "breakdown" in record:  # (a stall of this step's wall time, beside its own work)
                record["breakdown"]["components"]["checkpoint"] = record["checkpoint_s"]
                record["breakdown"]["total_s"] += record["checkpoint_s"]
        if (
            first_step
            and self.checkpointer is not None
            and self.cfg.checkpoint.async_
            and self.cfg.checkpoint.every > 0
        ):
            start = time.perf_counter()
            self.checkpointer.prepare_background()
            record["checkpoint_prepare_s"] = time.perf_counter() - start
        if self.val_batches and ((step + 1) % self.cfg.train.eval_every == 0 or step + 1 == self.cfg.train.steps):
            eval_start = time.perf_counter()
            val_loss = self.evaluate()  # (every rank; not at an `until` stop, so a resumed run logs alike)
            record["val_loss"], record["val_ppl"] = val_loss, math.exp(min(val_loss, 700.0))
            record["eval_s"] = time.perf_counter() - eval_start
            self.shown["val_loss"] = f"{val_loss:.4f}"


def _named_blocks(chunk):
    """(layer id, block) of a chunk's blocks; an MTP module's block is named "mtp.{k}"."""
    mtp = [(f"mtp.{k}", m.block) for k, m in chunk.mtp.items()] if chunk.mtp is not None and chunk.output else []
    return list(chunk.layers.items()) + mtp


def train_rank(
    cfg: Config,
    *,
    log: bool = True,
    progress: bool = True,
    return_state: bool = False,
    resume: str | None = None,
    until: int | None = None,
) -> TrainResult:
    """Entry point on each rank (process group already initialised). `log`: write the run directory
    (metrics, checkpoints); `progress`: rank 0 shows a progress bar; `return_state`: the result holds
    the full parameters; `resume`: a checkpoint to continue from; `until`: stop (and save) there."""
    preemption = PreemptionRequest()
    preemption.install()  # first: a SIGTERM while the model is built or loaded is acted on at step 1
    trainer = Trainer(cfg, log=log, resume=resume, preemption=preemption)
    try:
        metrics = trainer.fit(progress=progress, until=until)
        return trainer.result(metrics, return_state=return_state)
    except BaseException:
        trainer.tracker.close(failed=True)  # (marked failed; a restart or resume continues it)
        raise
    finally:
        trainer.close()
        # A destroyed group's threads and sockets go with its object, which the model's DTensors
        # and data-parallel state hold in reference cycles: free them now, not at some later run.
        del trainer
        gc.collect()


def run_training(
    cfg: Config,
    log: bool = True,
    progress: bool = True,
    return_state: bool = False,
    resume: str | None = None,
    until: int | None = None,
) -> TrainResult:
    """`train_rank` with its options in order: the test suite's call sites use it (`run_on_ranks(2,
    run_training, cfg, False, False, True)`); fived's own code calls train_rank by keyword."""
    return train_rank(cfg, log=log, progress=progress, return_state=return_state, resume=resume, until=until)
