"""Schedule action lists generated without running: textbook bubbles, well-formed lists, in-flight
micro-batches, and exactly what the runtime executes on real gloo ranks."""

from collections import Counter

import pytest

from fived.layout.schedule_sim import (
    SCHEDULES,
    analyse,
    bubble_of,
    check_schedule,
    in_flight_microbatches,
    n_stages_of,
    peak_alive,
    schedule_actions,
    schedule_bubble,
    simulate,
)
from fived.layout.stages import stage_rank
from fived.testing import run_on_ranks, tiny_config
from fived.training.trainer import run_training

LOOPED_VIRTUAL = ("interleaved-1f1b", "zero-bubble")


def _runnable(schedule, p, v, m):
    try:
        check_schedule(schedule, p, v, m)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (2, 7), (3, 5), (4, 4), (4, 16), (8, 8), (8, 33), (16, 64)])
def test_gpipe_and_1f1b_bubble_is_textbook(schedule, p, m):
    simulated = simulate(schedule_actions(schedule, p, 1, m), p)["bubble"]
    for bubble in (schedule_bubble(schedule, p, 1, m), simulated):  # (the first: a closed form past pp 1)
        assert bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_closed_forms_are_the_simulation_s_floats(schedule):
    """`analyse` prices GPipe and 1F1B without simulating: the same bubble and in-flight counts, bit
    for bit, as the simulation of the lists the runtime executes (the planner's figures unchanged)."""
    for p in range(2, 17):
        for m in range(p, 3 * p + 3):
            actions = schedule_actions(schedule, p, 1, m)
            simulated = simulate(actions, p)["bubble"], tuple(float(peak_alive(actions[r])) for r in range(p))
            assert analyse(schedule, p, 1, m) == simulated, (p, m)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_generated_lists_are_complete_and_on_the_runtime_ranks(schedule):
    for p in (2, 3, 4, 8):
        for m in (p, p + 1, 2 * p, 3 * p, 4 * p + 2):
            for v in (1, 2, 3) if schedule in LOOPED_VIRTUAL else (1,):
                if not _runnable(schedule, p, v, m):
                    continue
                acts = schedule_actions(schedule, p, v, m)
                n_stages = n_stages_of(schedule, p, v)
                assert sorted(acts) == list(range(p))
                count = Counter()
                for rank, actions in acts.items():
                    assert len(set(actions)) == len(actions)
                    for kind, stage, mb in actions:
                        assert stage_rank(stage, p, schedule) == rank and 0 <= mb < m
                        count[kind, stage, mb] += 1
                for stage in range(n_stages):
                    for mb in range(m):  # one forward, and one full backward or an I and a W
                        assert count["F", stage, mb] == 1
                        assert count["B", stage, mb] + count["I", stage, mb] == 1
                        assert count["W", stage, mb] == count["I", stage, mb]
                assert 0 <= schedule_bubble(schedule, p, v, m) < 1  # simulate() raises on a deadlock


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_schedules_beat_interleaved_beats_1f1b(p, m):
    textbook = schedule_bubble("1f1b", p, 1, m)
    interleaved = schedule_bubble("interleaved-1f1b", p, 2, m)
    assert interleaved < textbook
    for zb in ("zero-bubble", "zbv", "dualpipev"):
        assert schedule_bubble(zb, p, 2, m) < interleaved, zb


def test_the_runtime_s_refusals_are_refused():
    for args in [
        ("1f1b", 4, 1, 3),
        ("gpipe", 4, 1, 2),
        ("dualpipev", 4, 2, 7),
        ("interleaved-1f1b", 4, 2, 9),
        ("zero-bubble", 4, 2, 9),
        ("nope", 2, 1, 4),
    ]:
        with pytest.raises(ValueError):
            schedule_actions(*args)
    assert schedule_actions("dualpipev", 4, 2, 8) and schedule_actions("interleaved-1f1b", 4, 2, 10)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 9), (8, 32)])
def test_in_flight_of_gpipe_and_1f1b(p, m):
    assert in_flight_microbatches("gpipe", p, 1, m) == [m] * p
    # torch's 1F1B warms up with min(m, pp - rank) forwards before its first backward
    assert in_flight_microbatches("1f1b", p, 1, m) == [min(p - r, m) for r in range(p)]


def test_without_a_pipeline_one_micro_batch_is_in_flight():
    # pp == 1 is gradient accumulation: each micro-batch's backward follows its forward
    for schedule in SCHEDULES:
        assert in_flight_microbatches(schedule, 1, 2, 6) == [1] and schedule_bubble(schedule, 1, 2, 6) == 0


def test_in_flight_counts_activations_until_w():
    # F0 F1 alive together; I0 frees nothing (W0 needs the inputs), W0 frees one, F2 makes two again
    assert peak_alive([("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("F", 0, 2), ("W", 0, 0), ("B", 0, 1), ("B", 0, 2)]) == 3
    assert peak_alive([("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("B", 0, 2)]) == 2
    # ZB-V (2 stages per rank) keeps pp micro-batches in flight on every rank once m >= 2pp - 1,
    # like 1F1B's first rank; interleaved 1F1B keeps more on its first rank than 1F1B does
    for p in (2, 4, 8):
        for m in (2 * p - 1, 2 * p, 4 * p):
            assert in_flight_microbatches("zbv", p, 2, m) == [p] * p
        assert in_flight_microbatches("interleaved-1f1b", p, 2, 2 * p)[0] > p


def _timelines(configs):
    """On each rank: the executed compute actions (kind, stage, microbatch), in order, per config."""
    out = []
    for cfg in configs:
        timeline = run_training(cfg, False, False).timeline
        out.append([(a.kind, a.stage, a.microbatch) for a in timeline if a.kind in ("F", "B", "I", "W")])
    return out


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_generated_actions_are_what_the_runtime_executes(p, m):
    cases = [(s, 2 if s in LOOPED_VIRTUAL else 1) for s in SCHEDULES]
    configs = [
        tiny_config(
            "tiny",
            parallel__dp=1,
            parallel__pp=p,
            parallel__pp_schedule=s,
            parallel__pp_virtual=v,
            train__microbatches=m,
            train__global_batch=m,
            train__seq_len=8,
            train__steps=1,
            model__n_layers=2 * p,
        )
        for s, v in cases
    ]
    per_rank = run_on_ranks(p, _timelines, configs)  # one set of ranks runs every schedule
    for i, (schedule, v) in enumerate(cases):
        executed = {rank: per_rank[rank][i] for rank in range(p)}
        assert executed == schedule_actions(schedule, p, v, m), schedule  # same sequences, rank by rank
        n_stages = n_stages_of(schedule, p, v)
        assert schedule_bubble(schedule, p, v, m) == simulate(executed, n_stages)["bubble"]


def test_bubble_of_recorded_actions_matches():
    from fived.parallel.pipeline import Action

    acts = schedule_actions("zbv", 2, 2, 4)
    recorded = [Action(r, k, s, mb, float(t), float(t)) for r, lst in acts.items() for t, (k, s, mb) in enumerate(lst)]
    assert bubble_of(recorded, 4) == schedule_bubble("zbv", 2, 2, 4)
