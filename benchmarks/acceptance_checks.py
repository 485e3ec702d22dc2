"""The correctness checks of benchmarks/gpu_acceptance.py: training on the device against the same
steps on CPU, the measured step breakdown adding up there, the fused ring-attention blocks and the grouped-GEMM experts against their reference
paths, a checkpoint's round trip and `fived generate` on the device.

Each check returns {"status": PASS | FAIL | SKIP, "figures": {...}, "note": "..."}; the driver
runs it guarded (an exception is that check's FAIL, not the run's end).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch

from fived.checkpoint.checkpointer import find_checkpoint
from fived.launch.ranks import run_ranks
from fived.model.attention import (
    block_backward,
    block_forward,
    reference_block_backward,
    reference_block_forward,
    uses_cuda_flash,
)
from fived.model.grouped_gemm import expert_loop, grouped_swiglu, uses_grouped_mm
from fived.testing import tiny_config
from fived.tools.verification import compare
from fived.training.trainer import run_training

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

# float32 on two devices differs by rounding only. Measured on CPU, float32 against float64 over 4
# steps of tiny / tiny-moe: losses and gradient norms 2e-7 to 4e-7 apart, parameters 1e-5 (AdamW's
# normalisation turns last-bit differences of small gradients into whole update-size ones). The
# limits leave 100x for the device's other summation orders; a wrong kernel moves a loss by 1e-3.
TRAIN_TOLERANCE = {"loss": 1e-4, "grad_norm": 1e-4, "aux_loss": 1e-4, "val_loss": 1e-4, "params": 1e-3}
# Relative norm error of a fused kernel against the float64 reference on the same inputs: bf16
# outputs carry 2^-9 rounding (plus bf16 accumulation in the grouped GEMM's gradients); float32 ones
# (the CPU smoke run) ~1e-7.
KERNEL_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
# Ring blocks as a rank of a cp ring computes them on its local tokens (two chunks, see
# parallel/context.py): (name, query rows, key rows, causal) as halves of the local length: its own
# chunks (causal), an earlier rank's first chunk seen by all its queries, a later rank's two chunks
# seen by its late chunk only.
RING_BLOCKS = [
    ("own chunks, causal", (0, 2), (0, 2), True),
    ("earlier rank", (0, 2), (0, 1), False),
    ("later rank", (1, 2), (0, 2), False),
]


def outcome(ok: bool, figures: dict, note: str = "") -> dict:
    return {"status": PASS if ok else FAIL, "figures": figures, "note": note}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (inf for a NaN, so that it fails)."""
    diff = torch.linalg.vector_norm(got.double() - want.double()) / torch.linalg.vector_norm(want.double()).clamp_min(
        1e-300
    )
    value = diff.item()
    return value if value == value else float("inf")


def training_matches_cpu(model: str, *, device: str, steps: int = 4) -> dict:
    """`steps` float32 training steps of a tiny preset through fived's trainer (one rank) on `device`
    and on CPU: same seed, data and layout; losses, gradient norms and final weights compared."""
    runs = {}
    for where in dict.fromkeys((device, "cpu")):  # (once when the device is the CPU)
        cfg = tiny_config(model, train__steps=steps, train__dtype="float32", train__device=where)
        runs[where] = run_ranks(1, run_training, cfg, False, False, True, device=where, deadline_s=600)[0]
    report = compare(runs["cpu"], runs[device])
    figures = {f"max_rel_{key}": value for key, value in report.max_rel.items()}
    figures.update(
        steps=steps,
        worst_param=report.worst_param,
        loss_first=runs[device].metrics[0]["loss"],
        loss_last=runs[device].metrics[-1]["loss"],
    )
    failed = [key for key, value in report.max_rel.items() if not value <= TRAIN_TOLERANCE[key]]
    note = (
        f"{device} vs cpu, float32"
        + (" (one run: the plumbing only)" if device == "cpu" else "")
        + (f"; over tolerance: {', '.join(failed)}" if failed else "")
    )
    return outcome(not failed, figures, note)


def breakdown_adds_up(*, device: str, steps: int = 4) -> dict:
    """The measured step breakdown (fived.training.step_timer: CUDA events on a GPU) of a tiny run on `device`:
    every step's components sum to the breakdown's total; the named ones (all but "other") cover at
    least 95% of it, and the total is the step time the trainer logs within 5%: in every step on a GPU,
    in all steps but one on CPU (a CPU step of a few ms that a loaded machine's scheduler suspends
    outside every span says nothing of the bookkeeping: CI failed on one such step)."""
    cfg = tiny_config("tiny", train__steps=steps, train__dtype="float32", train__device=device, train__microbatches=2)
    result = run_ranks(1, run_training, cfg, False, False, False, device=device, deadline_s=600)[0]
    named_shares, total_gaps = [], []
    for record in result.metrics:
        b = record["breakdown"]
        named = sum(v for k, v in b["components"].items() if k != "other")
        assert abs(sum(b["components"].values()) - b["total_s"]) <= 1e-6 * b["total_s"]
        named_shares.append(named / b["total_s"])
        total_gaps.append(abs(b["total_s"] / record["step_time_s"] - 1))
    last = result.metrics[-1]["breakdown"]["components"]
    missed = sum(1 for named, gap in zip(named_shares, total_gaps) if named < 0.95 or gap > 0.05)
    figures = {
        "min_named_share": min(named_shares),
        "max_total_vs_step_time": max(total_gaps),
        "steps_missed": missed,
        "last_step_ms": {k: v * 1e3 for k, v in last.items()},
    }
    allowed = 0 if device.startswith("cuda") else 1
    return outcome(missed <= allowed, figures, f"{device}, {steps} steps, 2 micro-batches")


def _random(shape, *, device: str, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)  # (drawn on CPU: the same values on every device)
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def ring_block_errors(
    head_dim: int, causal: bool, rows: slice, keys: slice, *, local_len: int, device: str, dtype: torch.dtype
) -> dict:
    """One ring block through the fused kernel and through the reference (float64, same inputs):
    relative errors of the output, log-sum-exp and the three gradients. GQA 8 query / 2 kv heads;
    the block's inputs are slices of the local tokens (strided views), as the ring passes them."""
    batch, q_heads, kv_heads = 2, 8, 2
    q = _random((batch, q_heads, local_len, head_dim), device=device, dtype=dtype, seed=1)[:, :, rows]
    k, v = (
        _random((batch, kv_heads, local_len, head_dim), device=device, dtype=dtype, seed=s)[:, :, keys] for s in (2, 3)
    )
    dout = _random(q.shape, device=device, dtype=dtype, seed=4)
    scale = head_dim**-0.5
    out, lse = block_forward(q, k, v, causal, scale)
    grads = block_backward(dout, q, k, v, out, lse, causal, scale)
    wide = [t.double() for t in (q, k, v, dout)]
    ref_out, ref_lse = reference_block_forward(*wide[:3], causal, scale)
    ref_grads = reference_block_backward(wide[3], *wide[:3], ref_out, ref_lse, causal, scale)
    errors = {"out": relative_error(out, ref_out), "lse": relative_error(lse, ref_lse)}
    errors.update({name: relative_error(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    return errors


def ring_blocks_match_reference(
    *, device: str, dtype: torch.dtype, local_len: int = 256, head_dims: tuple[int, ...] = (64, 128)
) -> dict:
    """The fused ring's blocks (CUDA flash in bf16; the CPU flash kernel on CPU), forward and
    backward, against the explicit-score reference: each block shape the ring computes."""
    probe = torch.empty((1, 1, 1, head_dims[0]), device=device, dtype=dtype)
    kernel = "cuda flash" if uses_cuda_flash(probe) else ("cpu flash" if device == "cpu" else "reference (no flash)")
    if device != "cpu" and kernel != "cuda flash":
        return outcome(False, {"kernel": kernel}, f"{dtype} blocks on {device} do not take CUDA flash")
    figures, worst = {"kernel": kernel, "dtype": str(dtype), "local_len": local_len}, 0.0
    for head_dim in head_dims:
        for name, (q_start, q_end), (k_start, k_end), causal in RING_BLOCKS:
            half = local_len // 2
            errors = ring_block_errors(
                head_dim,
                causal,
                slice(q_start * half, q_end * half),
                slice(k_start * half, k_end * half),
                local_len=local_len,
                device=device,
                dtype=dtype,
            )
            figures[f"d{head_dim} {name}"] = errors
            worst = max(worst, *errors.values())
    figures["worst_rel_error"] = worst
    limit = KERNEL_TOLERANCE[dtype]
    return outcome(worst <= limit, figures, f"{kernel} vs float64 reference, tolerance {limit:g}")


def grouped_experts_match_loop(*, device: str, dtype: torch.dtype, dim: int = 256, hidden: int = 512) -> dict:
    """fived's grouped experts op (torch._grouped_mm in bf16 on CUDA; per-expert slices on CPU)
    against the per-expert loop in float64: output and the gradients of input and the 3 weights.
    Counts are uneven, with empty experts, as routing gives them."""
    counts = [37, 0, 130, 5, 64, 91, 0, 17]
    n = len(counts)
    x = _random((sum(counts), dim), device=device, dtype=dtype, seed=5).requires_grad_()
    weights = [
        _random(shape, device=device, dtype=dtype, seed=6 + i, scale=shape[1] ** -0.5).requires_grad_()
        for i, shape in enumerate([(n, dim, hidden), (n, dim, hidden), (n, hidden, dim)])
    ]
    path = (
        "torch._grouped_mm" if uses_grouped_mm(x, weights[0]) else ("cpu slices" if device == "cpu" else "padded bmm")
    )
    if device != "cpu" and path != "torch._grouped_mm":
        return outcome(False, {"path": path}, f"{dtype} experts on {device} do not take torch._grouped_mm")
    out = grouped_swiglu(x, *weights, torch.tensor(counts, device=device))
    grad_out = _random(out.shape, device=device, dtype=dtype, seed=9)
    grads = torch.autograd.grad(out, [x, *weights], grad_out)
    wide = [t.detach().double().requires_grad_() for t in (x, *weights)]
    ref = expert_loop(wide[0], *wide[1:], counts)
    ref_grads = torch.autograd.grad(ref, wide, grad_out.double())
    figures = {"path": path, "dtype": str(dtype), "counts": counts, "out": relative_error(out, ref)}
    figures.update({name: relative_error(g, r) for name, g, r in zip(("dx", "dw1", "dw3", "dw2"), grads, ref_grads)})
    worst = max(v for k, v in figures.items() if k not in ("path", "dtype", "counts"))
    figures["worst_rel_error"] = worst
    limit = KERNEL_TOLERANCE[dtype]
    return outcome(worst <= limit, figures, f"{path} vs the float64 expert loop, tolerance {limit:g}")


def train_and_save(run_dir: str, *, device: str, steps: int = 2):
    """A short float32 tiny run on `device` that checkpoints at its end; (config, final weights)."""
    cfg = tiny_config(
        "tiny",
        train__steps=steps,
        train__dtype="float32",
        train__device=device,
        train__output_dir=run_dir,
        checkpoint__final=True,
    )
    return cfg, run_ranks(1, run_training, cfg, True, False, True, device=device, deadline_s=600)[0].state


def checkpoint_round_trip(run_dir: str, *, device: str) -> dict:
    """Save a run's checkpoint on `device`, load it into a fresh trainer there: every weight equal
    bit for bit to what was saved."""
    cfg, saved = train_and_save(run_dir, device=device)
    checkpoint = find_checkpoint(run_dir)
    loaded = run_ranks(1, run_training, cfg, False, False, True, str(checkpoint), device=device, deadline_s=600)[
        0
    ].state
    unequal = [name for name, value in saved.items() if not torch.equal(value, loaded[name])]
    figures = {
        "checkpoint": Path(checkpoint).name,
        "tensors": len(saved),
        "unequal": unequal[:5],
        "bytes": sum(v.numel() * v.element_size() for v in saved.values()),
    }
    return outcome(not unequal and set(saved) == set(loaded), figures, "save, then load into a new trainer")


def _generate_ids(run_dir: str, device: str) -> list[int]:
    """`fived generate RUN --json` in this process (float64: greedy picks cannot tie differently)."""
    from fived.cli.main import main as fived_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = fived_main(
            [
                "generate",
                run_dir,
                "--prompt",
                "The ",
                "--max-new-tokens",
                "16",
                "--dtype",
                "float64",
                "--device",
                device,
                "--json",
            ]
        )
    if code != 0:
        raise RuntimeError(f"fived generate --device {device} exited {code}")
    return json.loads(printed.getvalue().strip().splitlines()[-1])["generated_ids"]


def generate_matches_cpu(run_dir: str, *, device: str) -> dict:
    """`fived generate` of a checkpointed run on `device` and on CPU: the same greedy tokens."""
    if find_checkpoint(run_dir) is None:  # (the round-trip check writes it; run alone, write one)
        train_and_save(run_dir, device=device)
    on_device, on_cpu = _generate_ids(run_dir, device), _generate_ids(run_dir, "cpu")
    figures = {"tokens": len(on_device), "ids": on_device, "cpu_ids": on_cpu}
    same_device = " (the plumbing only)" if device == "cpu" else ""
    return outcome(bool(on_device) and on_device == on_cpu, figures, f"greedy, float64, {device} vs cpu{same_device}")
