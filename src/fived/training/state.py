"""The stateful parts of a training run, each handed to the checkpointer by name (as torchtitan does).

Every component gives two things: tensors, as `ShardedValue`s placed by the parallel plan's
placement table, which DCP writes and reads in place under any layout; and a small JSON state
(step counters, the sampler's position) that goes into the checkpoint's manifest. Nothing here
depends on the layout that saved a checkpoint.

  model       every parameter and buffer (router biases), by canonical name
  optimizer   AdamW's moments, placed like their parameter (ZeRO-1/2 slices, ZeRO-3 rows included),
              and its step count per parameter; with train.optimizer=muon, each Muon matrix's
              momentum_buffer instead, placed alike
  progress    the step, the sampler's position and the learning-rate schedule's
  rng         the CPU generator's state (fived draws no random numbers after initialisation; kept
              so that anything added later that does resumes exactly too)
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import cast

import torch
import torch.distributed as dist

from fived.checkpoint.dcp_io import ShardedValue
from fived.layout.placement import Box, Placement
from fived.model.ledger import local_tensor
from fived.optim.muon import Muon


def _value(placement: Placement, stored: torch.Tensor) -> ShardedValue:
    stored = local_tensor(stored).detach()
    return ShardedValue(placement.global_shape, placement.pieces(stored), placement.replica == 0, stored.dtype)


def _scalar(tensor: torch.Tensor, write: bool) -> ShardedValue:
    return ShardedValue((), [(Box((), ()), tensor)], write, tensor.dtype)


class ModelState:
    def __init__(self, plan, chunks):
        self.plan, self.chunks = plan, chunks

    def tensors(self, for_load: bool) -> dict[str, ShardedValue]:
        from fived.model.transformer import canonical_name

        dp, placements = self.plan.data_parallel, self.plan.placements
        dp.wait_parameters()  # (an all-gather still in flight would write over what is read or loaded)
        out = {}
        if for_load and dp.master_pairs:  # bf16 runs: the float32 masters; the model follows (load_state)
            for name, master in dp.optimized():
                out[name] = _value(placements[name], master)
        elif for_load:  # every rank fills what its model holds (a ZeRO-1/2 rank: whole parameters)
            for name, param in dp.named_parameters():
                out[name] = _value(dataclasses.replace(placements[name], flat=None), param)
        else:  # what the optimizer updates here: each ZeRO-1/2 rank writes its slice
            for name, stored in dp.optimized():
                out[name] = _value(placements[name], stored)
        for chunk in self.chunks:
            for raw, buffer in chunk.named_buffers():
                name = canonical_name(raw)
                out[name] = _value(placements[name], buffer)
        return out

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        if self.plan.data_parallel.master_pairs:
            self.plan.data_parallel.masters_to_model()


class OptimizerState:
    MOMENTS = ("exp_avg", "exp_avg_sq")

    def __init__(self, plan, optimizer: torch.optim.Optimizer):
        self.plan, self.optimizer = plan, optimizer

    def _muon(self, param) -> bool:
        """Whether `param` is a matrix Muon orthogonalises (its state: one momentum buffer, no step)."""
        return isinstance(self.optimizer, Muon) and self.optimizer.orthogonalizes(param)

    def tensors(self, for_load: bool) -> dict[str, ShardedValue]:
        out = {}
        for name, param in self.plan.data_parallel.optimized():
            placement = self.plan.placements[name]
            state = self.optimizer.state[param]
            muon = self._muon(param)
            if for_load and not state:  # a fresh optimizer: make the state DCP fills
                state.update(
                    cast(Muon, self.optimizer).fresh_state(param)
                    if muon
                    else {
                        "step": torch.zeros((), dtype=_step_dtype()),
                        **{k: torch.zeros_like(param) for k in self.MOMENTS},
                    }
                )
            for key in Muon.STATE if muon else self.MOMENTS:
                out[f"{name}.{key}"] = _value(placement, state[key])
            if not muon:
                out[f"{name}.step"] = _scalar(state["step"], placement.holds_origin)
        return out

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


def _step_dtype() -> torch.dtype:
    # what torch's AdamW itself uses for its step counter (not fused, not capturable)
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


class ProgressState:
    def __init__(self, sampler, scheduler):
        self.sampler, self.scheduler = sampler, scheduler

    def tensors(self, for_load: bool) -> dict[str, ShardedValue]:
        return {}

    def state(self) -> dict:
        return {
            "step": self.sampler.step,
            "sampler": self.sampler.state_dict(),
            "scheduler_last_epoch": self.scheduler.last_epoch,
        }

    def load_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        # LambdaLR's closed form: the lr of epoch N is base_lr * multiplier(N), whatever came before.
        # (torch warns that this step precedes optimizer.step(); here that is the point.)
        self.scheduler.last_epoch = state["scheduler_last_epoch"] - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()


class RNGState:
    def __init__(self):
        self.buffer = torch.get_rng_state()

    def tensors(self, for_load: bool) -> dict[str, ShardedValue]:
        if not for_load:
            self.buffer = torch.get_rng_state()
        n = self.buffer.numel()
        return {"cpu": ShardedValue((n,), [(Box((0,), (n,)), self.buffer)], dist.get_rank() == 0, self.buffer.dtype)}

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        torch.set_rng_state(self.buffer)
