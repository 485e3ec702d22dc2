"""The planner's pruned search (`plan(keep=K)`, what `fived plan` runs): a fitting layout whose step
floor (`timing.step_floor`) is already slower than what it could be printed as is not priced
(`fived.planner.pricing`). Run both ways on small cases, it must print the same plans: the K fastest,
every runner-up, the least memory per decision, the counts."""

import pytest

from fived.config import model_preset
from fived.planner.explain import runners_up
from fived.planner.hardware import hardware
from fived.planner.runtimes import PLANNED_RUNTIMES
from fived.planner.search import Search, plan
from fived.planner.timing import Cluster

# (model, GPU, GPUs, seq, global batch in sequences, runtime, headroom GiB)
CASES = [
    ("llama3-8b", "h100", 4, 4096, 16, "fived", 3.0),
    ("llama3-8b", "a100", 4, 2048, 32, "megatron-core", 0.0),
    ("llama3-8b", "h800", 4, 8192, 8, "fsdp", 3.0),
    ("llama3-8b", "h100", 4, 2048, 16, "fived-fp8", 3.0),
    ("tiny-moe", "h100", 4, 2048, 16, "fived", 3.0),
]


def _printed(search: Search, keep: int) -> tuple:
    """What `fived plan` reads from a search (explain.report / to_json)."""
    top = [(p.layout, p.time.total, p.memory.total) for p in search.plans[:keep]]
    runners = [(d, v, p and (p.layout, p.time.total)) for d, v, p in runners_up(search)] if search.plans else []
    return top, runners, search.considered, search.fitting, search.smallest


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:3])) + f"-{c[5]}")
def test_pruned_search_prints_what_the_whole_search_does(case):
    name, gpu, gpus, seq, batch, runtime, headroom = case
    model, cluster = model_preset(name), Cluster(hardware(gpu), gpus, 8)
    whole = plan(model, cluster, seq, batch, "bfloat16", PLANNED_RUNTIMES[runtime], headroom)
    assert whole.fitting == len(whole.plans) > 5
    for keep in (1, 5):
        pruned = plan(model, cluster, seq, batch, "bfloat16", PLANNED_RUNTIMES[runtime], headroom, keep=keep)
        assert _printed(pruned, keep) == _printed(whole, keep)
        assert len(pruned.plans) < len(whole.plans)  # (it did prune: the comparison tests something)
