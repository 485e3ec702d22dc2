"""FP8 linears (`train.fp8 = "tensorwise" | "rowwise"`) with torchao's float8 training, applied from
outside the model: each eligible `nn.Linear` is swapped for torchao's `Float8Linear` (a subclass of
`nn.Linear` holding the *same* `weight` Parameter), whose matmuls cast input, weight and output
gradient to float8 with dynamic scales and keep everything else (weights, gradients, optimizer
state, communication) in `train.dtype`.

Applied by `fived.parallel.parallelize` after tensor / context / expert parallelism and before
activation checkpointing, compile and data parallelism (ZeRO / FSDP2):
- names are unchanged (the swapped module sits under the same attribute and keeps `weight`), so
  sharding specs, placements and checkpoints see the canonical names of a bf16 run;
- tensor parallelism's hooks sit on the attention / feed-forward blocks and the head, never on the
  swapped linears, and its cut (a smaller `weight` on meta) is what `Float8Linear` adopts.

Not converted (`converts`):
- the output head (`output`): the logits are the most precision-sensitive matmul (torchao's and
  torchtitan's rule);
- the MoE router (`router`): its scores choose the experts; an fp8 rounding could flip a choice;
- linears with a dimension that is not a multiple of 16 (what FP8 GEMMs require);
- the grouped expert weights (`GroupedExperts`: [E, ...] Parameters, not `nn.Linear`); they run in
  `train.dtype` through `fived.model.grouped_gemm`.
torchao's size thresholds (`_auto_filter_for_recipe`: skip small GEMMs that are slower in FP8 on an
H100) are not applied: they are a speed heuristic, and they would leave the tiny test models unconverted.

Scales under our (non-DTensor) tensor parallelism: torchao computes each amax over the tensor it is
given, so a tp-sharded weight (and a row-parallel input, a column-parallel output gradient) is
scaled over its local shard (finer than one scale for the whole tensor); data parallelism scales
activations and output gradients over the local micro-batch. An FP8 run is therefore close to, not
identical with, the one-device FP8 run (see tests/test_fp8.py for the measured differences).

Not used: torchao's `enable_fsdp_float8_all_gather` (FSDP2 gathers float8 weights). Its amax
all-reduce is a functional collective outside `fived.parallel.comm` (unledgered, unattributed) and the
float8 gather changes the bytes the planner prices; ZeRO-3 gathers weights in the compute dtype and
each Float8Linear casts its gathered weight.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

SKIPPED_NAMES = ("output", "router")  # the head and the MoE router (see the module docstring)


def torchao_float8():
    """torchao's float8 package, imported with its CUDA-extension load warnings silenced on a machine
    without CUDA (they say a GPU library cannot load, which is irrelevant there). ImportError if absent."""
    quiet = not torch.cuda.is_available()
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    if quiet:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return float8


def hardware_fp8(device_type: str) -> bool:
    """Whether this device has FP8 tensor cores (CUDA compute capability >= 8.9: Ada, Hopper, later)."""
    return device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def float8_config(recipe: str, *, device_type: str):
    """torchao's config of a recipe; emulated (float8 rounding, high-precision matmuls) without FP8 hardware."""
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if not hardware_fp8(device_type):
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    return config


def converts(module: nn.Module, fqn: str) -> bool:
    """Whether the linear at `fqn` runs in FP8 (the module filter handed to torchao)."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in SKIPPED_NAMES:
        return False
    out_features, in_features = module.weight.shape  # (the local shard's, under tensor parallelism)
    return out_features % 16 == 0 and in_features % 16 == 0


def apply_fp8(chunks: Iterable[nn.Module], recipe: str, *, device_type: str) -> int:
    """Swap the eligible linears of every chunk for Float8Linear; returns how many were swapped."""
    if recipe == "none":
        return 0
    float8 = torchao_float8()
    config = float8_config(recipe, device_type=device_type)
    swapped = 0
    for chunk in chunks:
        before = fp8_linear_names(chunk)
        float8.convert_to_float8_training(chunk, module_filter_fn=converts, config=config)
        swapped += len(fp8_linear_names(chunk)) - len(before)
    return swapped


def fp8_linear_names(model: nn.Module) -> list[str]:
    """Module names of the linears that run in FP8 (empty when torchao was never imported)."""
    import sys

    if "torchao.float8" not in sys.modules:
        return []
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
