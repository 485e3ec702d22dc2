"""fived.compat: each shim over a private torch internal works on the installed torch (one test per
shim), and fived's own pipeline orders equal torch's."""

import pytest

from fived.compat import torch_pipeline_order
from fived.layout.layout import stages_per_rank
from fived.layout.schedule_orders import multi_stage_order


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"])
def test_the_planners_pipeline_orders_are_torchs(schedule):
    cases = 0
    for pp in (2, 3, 4, 5):
        for virtual in (1, 2, 3) if schedule in ("interleaved-1f1b", "zero-bubble") else (2,):
            local = stages_per_rank(schedule, virtual)
            for m in range(2 * pp if schedule == "dualpipev" else pp, 3 * pp + 3):
                if schedule in ("interleaved-1f1b", "zero-bubble") and m % max(1, m // pp):
                    continue  # (fived's config check refuses these, as torch's constructor does)
                torch_order = torch_pipeline_order(schedule, pp, local, m)
                assert sum(map(len, torch_order.values())) > 0
                for rank in range(pp):
                    assert multi_stage_order(schedule, pp, local, m, rank) == torch_order[rank], (pp, virtual, m, rank)
                cases += 1
    assert cases >= 10
