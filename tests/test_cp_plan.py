"""`fived plan` and context parallelism's modes: the search weighs ring, Ulysses and hybrid for every
cp degree, picks by predicted step time, and says why (the winner's exposed cp time against the same
layout's in every other mode)."""

import re
from dataclasses import replace

from fived.config import model_preset
from fived.planner import explain
from fived.planner.hardware import hardware
from fived.planner.search import cp_modes, plan
from fived.planner.timing import Cluster


def _plan(model, gpus: int, seq: int, global_batch: int):
    """The winner and the text `fived plan` prints, on H100s 8 per node."""
    cluster = Cluster(hardware("h100"), gpus, 8)
    search = plan(model, cluster, seq, global_batch)
    winner = search.plans[0]
    assert winner.layout.cp > 1
    return winner, explain.report(search, model, cluster, seq, global_batch, top=3)


def _says_why(model, winner, text: str) -> None:
    """The cp mode line names the winner's mode, then every other mode the heads allow, none faster."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  cp mode: "))
    assert lines[at].startswith(f"  cp mode: {winner.layout.cp_mode}")
    others = []
    for line in lines[at + 1 :]:
        if not line.startswith("    "):
            break
        others.append(line)
    assert len(others) == len(cp_modes(model, winner.layout.tp, winner.layout.cp)) - 1 > 0
    for line in others:
        assert float(re.search(r"step ([+-][0-9.]+)%", line).group(1)) >= 0.0, line


def test_the_ring_hides_behind_long_attention():
    """GQA (8 kv heads) at 128K tokens on a node: the ring's K/V hops hide behind the attention blocks.
    (Across nodes, cp16 on 2 or 8 of them, a fused causal kernel's half of the blocks no longer covers
    the hops between nodes: hybrid's Ulysses pairs inside a node win there, by under 1%.)"""
    model = model_preset("llama3-8b")
    winner, text = _plan(model, 8, 131072, 4)
    assert winner.layout.cp_mode == "ring"
    _says_why(model, winner, text)


def test_ulysses_wins_where_the_ring_cannot_hide():
    """Multi-head attention (32 kv heads) at 16K tokens over 4 nodes, one sequence: the ring's hops
    across nodes outlast the short attention; the all-to-alls cost less."""
    model = replace(model_preset("llama3-8b"), n_kv_heads=32, name="llama3-8b-mha")
    winner, text = _plan(model, 32, 16384, 1)
    assert winner.layout.cp_mode in ("ulysses", "hybrid")
    _says_why(model, winner, text)
    assert "--parallel.cp_mode " + winner.layout.cp_mode in text  # the printed command runs it
