"""`fived.tools.workers`: forked processes return what this process computes, in order; an error in one
reaches the caller; `fived explore`'s page data is the same on any number of them."""

import os

import pytest

from fived.tools.workers import Workers


def square_unless_seven(job, item):
    if item == 7:
        raise ValueError(f"{job}: seven")
    return job, item * item, os.getpid()


@pytest.mark.parametrize("n", [1, 3])
def test_map_yields_each_items_result_in_order_and_submit_waits_for_its_own(n):
    with Workers(n) as pool:
        later = pool.submit(square_unless_seven, "job", 5)
        out = list(pool.map(square_unless_seven, "job", range(7)))
        assert [(job, value) for job, value, _ in out] == [("job", i * i) for i in range(7)]
        assert later()[:2] == ("job", 25)
    assert (os.getpid() in {pid for *_, pid in out}) == (n == 1)  # (really other processes)


@pytest.mark.parametrize("n", [1, 2])
def test_an_error_in_a_worker_reaches_the_caller(n):
    with pytest.raises(ValueError, match="job: seven"), Workers(n) as pool:
        list(pool.map(square_unless_seven, "job", range(10)))


def test_explore_data_is_the_same_on_one_process_and_on_three():
    from fived.config import model_preset
    from fived.planner.hardware import hardware
    from fived.planner.timing import Cluster
    from fived.tools.explore import explore_data

    model, cluster = model_preset("mixtral-8x7b"), Cluster(hardware("h100"), 4, 8)
    one = explore_data(model, cluster, 4096, 16, "bfloat16", 0.0, workers=1)
    three = explore_data(model, cluster, 4096, 16, "bfloat16", 0.0, workers=3)
    assert sum(isinstance(e, list) for e in one["entries"]) > 100  # (valid: an array)
    assert one == three
