"""The planner's peak memory against fived's trainer on a CPU rank, where the loss's [tokens, vocab]
tensors dominate: a large vocabulary, a narrow model. What a longer sequence adds to the process's peak
resident set (`peak_mem_mb` on CPU: everything but the tokens cancels between the two runs) is what it
adds to `memory_per_gpu`: the log-probabilities the loss saves, and at the loss's backward the two
float32 gradients of the logits, and under a pipeline the logits torch's stage keeps until the
micro-batch's backward (before 2026-12-01 the planner counted one gradient, and the trainer also held
the logits through backward, as torch's schedule kept every micro-batch's output for the step); under
tp fived's vocab-parallel loss (`memory._loss_backward_bytes`)."""

import subprocess
import sys
from pathlib import Path

import pytest

from fived.config import build_config
from fived.layout.layout import Layout
from fived.planner.memory import memory_per_gpu
from fived.planner.runtimes import train_runtime

SHORT, LONG = 256, 2048


def _config(seq_len: int, checkpointing: str, dtype: str, pp: int = 1, tp: int = 1):
    return build_config(
        overrides={
            "model.vocab_size": 32768,
            "model.dim": 128,
            "model.ffn_dim": 512,
            "model.n_layers": 2,
            "train.seq_len": seq_len,
            "train.global_batch": pp,
            "train.microbatches": pp,
            "train.steps": 2,
            "train.warmup_steps": 1,
            "train.dtype": dtype,
            "train.activation_checkpointing": checkpointing,
            "train.log_every": 10**9,
            "parallel.dp": 1,
            "parallel.pp": pp,
            "parallel.tp": tp,
        }
    )


# Each run in a fresh interpreter: a rank forked from it starts at its resident size, the same for both
# runs of a test (forked from pytest's process, it was that process's size at the time, which moves)
_RUN = """
import sys
from fived.launch.ranks import run_ranks
from fived.training.trainer import run_training
sys.path.insert(0, sys.argv[1])
from test_memory_peak import _config
cfg = _config(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
ranks = run_ranks(cfg.parallel.pp * cfg.parallel.tp, run_training, cfg, False, False, False, device="cpu", deadline_s=300)
print(max(r["peak_mem_mb"] for rank in ranks for r in rank.metrics) / 1024)
"""


def _measured_gib(cfg) -> float:
    """The busiest rank's peak resident set."""
    t = cfg.train
    p = cfg.parallel
    args = [str(Path(__file__).parent), str(t.seq_len), t.activation_checkpointing, t.dtype, str(p.pp), str(p.tp)]
    done = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


def _planned_gib(cfg) -> float:
    t, world = cfg.train, cfg.parallel.pp * cfg.parallel.tp
    runtime = train_runtime(t, gpu=False)
    gib = memory_per_gpu(cfg.model, Layout.from_config(cfg, world), t.seq_len, t.global_batch, t.dtype, 24, runtime)
    return gib.gib()["total"] - gib.gib()["reserve"]


@pytest.mark.parametrize(
    "checkpointing,dtype,pp,tp",
    [("none", "float32", 1, 1), ("full", "bfloat16", 1, 1), ("none", "float32", 2, 1), ("none", "bfloat16", 1, 2)],
)
def test_what_a_longer_sequence_adds_to_the_peak_is_planned(checkpointing, dtype, pp, tp):
    """(pp 2: the last stage's peak, where torch's pipeline also keeps the micro-batch's logits; tp 2:
    fived's vocab-parallel loss, one float32 gradient at a time and its bf16 cast.)"""
    short, long = _config(SHORT, checkpointing, dtype, pp, tp), _config(LONG, checkpointing, dtype, pp, tp)
    measured = _measured_gib(long) - _measured_gib(short)  # (~0.8 GiB: the loss's tensors most of it)
    planned = _planned_gib(long) - _planned_gib(short)
    assert abs(planned / measured - 1) < 0.1, (planned, measured)
