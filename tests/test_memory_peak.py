"""The planner's peak memory against fived's trainer on a CPU rank, where the loss's [tokens, vocab]
tensors dominate: a large vocabulary, a narrow model. What a longer sequence adds to the process's peak
resident set (`peak_mem_mb` on CPU: everything but the tokens cancels between the two runs) is what it
adds to `memory_per_gpu`: the log-probabilities the loss saves, and at the loss's backward the two
float32 gradients of the logits (before 2026-12-01 the planner counted one, and the trainer also held
the logits themselves through backward)."""

import pytest

from fived.config import build_config
from fived.launch.ranks import run_ranks
from fived.layout.layout import Layout
from fived.planner.memory import memory_per_gpu
from fived.planner.runtimes import train_runtime
from fived.training.trainer import run_training

SHORT, LONG = 256, 2048


def _config(seq_len: int, checkpointing: str, dtype: str):
    return build_config(
        overrides={
            "model.vocab_size": 32768,
            "model.dim": 128,
            "model.ffn_dim": 512,
            "model.n_layers": 2,
            "train.seq_len": seq_len,
            "train.global_batch": 1,
            "train.steps": 2,
            "train.warmup_steps": 1,
            "train.dtype": dtype,
            "train.activation_checkpointing": checkpointing,
            "train.log_every": 10**9,
            "parallel.dp": 1,
        }
    )


def _measured_gib(cfg) -> float:
    records = run_ranks(1, run_training, cfg, False, False, False, device="cpu", deadline_s=300)[0].metrics
    return max(r["peak_mem_mb"] for r in records) / 1024


def _planned_gib(cfg) -> float:
    t = cfg.train
    gib = memory_per_gpu(cfg.model, Layout.from_config(cfg, 1), t.seq_len, 1, t.dtype, 24, train_runtime(t)).gib()
    return gib["total"] - gib["reserve"]


@pytest.mark.parametrize("checkpointing,dtype", [("none", "float32"), ("full", "bfloat16")])
def test_what_a_longer_sequence_adds_to_the_peak_is_planned(checkpointing, dtype):
    short, long = _config(SHORT, checkpointing, dtype), _config(LONG, checkpointing, dtype)
    measured = _measured_gib(long) - _measured_gib(short)  # (~0.8 GiB: the loss's tensors most of it)
    planned = _planned_gib(long) - _planned_gib(short)
    assert abs(planned / measured - 1) < 0.1, (planned, measured)
