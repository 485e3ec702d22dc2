"""Pipeline parallelism on real gloo ranks: every schedule exact against the single-process
reference, composed with DP/ZeRO and TP; bubbles simulated from the executed action lists; traces."""

import dataclasses
import json

import pytest

from fived.cli.main import main
from fived.config import model_preset
from fived.layout.layout import stages_per_rank
from fived.layout.schedule_sim import bubble_of, simulate
from fived.layout.stages import split_layers
from fived.testing import EXACT, run_forked, run_on_ranks, tiny_config
from fived.tools.verification import run_verify
from fived.training.trainer import run_training

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"]


def _virtual(schedule):
    return 2 if schedule in ("interleaved-1f1b", "zero-bubble") else 1


def _verify(world, model, **over):
    report = run_verify(tiny_config(model, train__steps=2, **over), world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_reference(pp, schedule, name):
    micro = 2 * pp if schedule == "dualpipev" else pp
    _verify(
        pp,
        name,
        parallel__dp=1,
        parallel__pp=pp,
        parallel__pp_schedule=schedule,
        parallel__pp_virtual=_virtual(schedule),
        train__microbatches=micro,
        train__global_batch=micro,
        model__n_layers=4 if pp == 2 else 8,
    )


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_with_data_and_tensor_parallel(schedule, zero):
    _verify(
        8,
        "tiny-moe",
        parallel__dp=2,
        parallel__tp=2,
        parallel__pp=2,
        parallel__zero=zero,
        parallel__pp_schedule=schedule,
        parallel__pp_virtual=_virtual(schedule),
        train__microbatches=2,
    )


def test_uneven_split_and_sequence_parallel():
    _verify(
        4,
        "tiny",
        parallel__dp=1,
        parallel__tp=2,
        parallel__sp=True,
        parallel__pp=2,
        parallel__pp_layers="3,1",
        train__microbatches=2,
    )


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_bubbles_from_executed_actions(p, m):
    bubbles = {}
    for schedule in SCHEDULES:
        if schedule == "dualpipev" and m < 2 * p:
            continue
        v = _virtual(schedule)
        cfg = tiny_config(
            "tiny",
            parallel__dp=1,
            parallel__pp=p,
            parallel__pp_schedule=schedule,
            parallel__pp_virtual=v,
            train__microbatches=m,
            train__global_batch=m,
            train__seq_len=8,
            train__steps=1,
            model__n_layers=8,
        )
        actions = [a for res in run_on_ranks(p, run_training, cfg, False, False) for a in res.timeline]
        assert {a.kind for a in actions} >= {"F", "send_f", "recv_f"}
        bubbles[schedule] = bubble_of(actions, p * stages_per_rank(schedule, v))
    textbook = (p - 1) / (m + p - 1)
    assert bubbles["gpipe"] == pytest.approx(textbook, abs=1e-12)
    assert bubbles["1f1b"] == pytest.approx(textbook, abs=1e-12)
    assert bubbles["interleaved-1f1b"] < textbook
    for zb in ("zero-bubble", "zbv", "dualpipev"):
        if zb in bubbles:
            assert bubbles[zb] < bubbles["interleaved-1f1b"], (zb, bubbles)


def test_simulator_on_a_hand_written_gpipe():
    p, m = 3, 5
    lists = {r: [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)}
    out = simulate(lists, p)
    assert out["makespan"] == 3 * (m + p - 1)
    assert out["bubble"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)


def test_split_is_balanced_by_cost_and_can_be_overridden():
    cfg = dataclasses.replace(model_preset("tiny"), n_layers=8, vocab_size=1152)  # (a head of two layers' cost)
    split = split_layers(cfg, 4)
    assert [layer for stage in split for layer in stage] == list(range(8))
    assert len(split[-1]) == 1 and sorted(len(s) for s in split[:-1]) == [2, 2, 3]
    cfg = dataclasses.replace(cfg, vocab_size=64)  # a negligible head: even split
    assert [len(s) for s in split_layers(cfg, 4)] == [2, 2, 2, 2]
    assert split_layers(cfg, 2, "5,3") == [[0, 1, 2, 3, 4], [5, 6, 7]]


def test_split_is_the_exhaustive_optimum():
    """`split_layers` (a dynamic programme that stops widening a stage once it alone costs more than the
    best split found) reaches the least (most expensive stage, sum of squared stage costs) of every
    contiguous split, found by trying them all: uneven layer costs (MoE layers after dense ones) and
    heads from negligible to several layers' cost."""
    from itertools import combinations, pairwise

    from fived.layout.stages import layer_costs

    def value(costs, head, cuts):  # (the most expensive stage, the sum of squared stage costs)
        stages = [sum(costs[a:b]) for a, b in pairwise([0, *cuts, len(costs)])]
        stages[-1] += head
        return max(stages), sum(c * c for c in stages)

    for vocab, name in ((64, "tiny"), (1152, "tiny"), (4096, "tiny"), (512, "tiny-moe"), (8192, "tiny-moe")):
        cfg = dataclasses.replace(model_preset(name), n_layers=9, vocab_size=vocab)
        costs, head = layer_costs(cfg)
        for n_stages in range(1, 10):
            split = split_layers(cfg, n_stages)
            assert [layer for stage in split for layer in stage] == list(range(9)) and all(split)
            cuts = [sum(len(s) for s in split[:k]) for k in range(1, n_stages)]
            best = min(value(costs, head, c) for c in combinations(range(1, 9), n_stages - 1))
            assert value(costs, head, cuts) == pytest.approx(best, rel=1e-12), (name, vocab, n_stages)


def test_trace_of_an_8_rank_run_is_chrome_json(tmp_path):
    trace = tmp_path / "trace.json"
    res = run_forked(
        main,
        [
            "train",
            "--nproc",
            "8",
            "--dp",
            "2",
            "--pp",
            "4",
            "--pp-schedule",
            "interleaved-1f1b",
            "--pp-virtual",
            "2",
            "--model.n_layers",
            "8",
            "--microbatches",
            "4",
            "--steps",
            "2",
            "--trace",
            str(trace),
            "--train.output_dir",
            str(tmp_path / "run"),
        ],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(8))
    assert {e["cat"] for e in spans} >= {"F", "B", "send_f", "recv_f", "send_b", "recv_b"}
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in spans)
