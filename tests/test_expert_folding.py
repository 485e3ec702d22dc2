"""MoE parallel folding (parallel.etp=1) on real gloo ranks: whole routed experts, expert parallelism
over dp*cp*tp, each tp rank routing its own sequence shard. Exact against one device in float64
under every ZeRO stage, a pipeline, context parallelism and both overlaps; checkpoints move between
folded and unfolded layouts exactly; the expert groups are the ones the layout describes; the
combinations it does not run are refused in one line."""

import pytest

from fived.config import ConfigError
from fived.layout.layout import Layout
from fived.layout.rules import layout_errors
from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import run_verify

FOLD = dict(parallel__tp=2, parallel__sp=True, parallel__etp=1)


def _verify(world, **over):
    over.setdefault("train__steps", 2)
    report = run_verify(tiny_config("tiny-moe", **FOLD, **over), world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel
    assert "aux_loss" in report.max_rel  # (the load-balancing loss compared too)
    return report


LAYOUTS = {  # world, fields: tiny-moe has 8 experts and one shared expert (a tp region of its own)
    "dp2-ep2": (4, dict(parallel__dp=2, parallel__ep=2)),  # ep groups are tp pairs
    "dp2-ep4-zero1-micro2": (4, dict(parallel__dp=2, parallel__ep=4, parallel__zero=1, train__microbatches=2)),
    "dp2-ep4-zero3": (4, dict(parallel__dp=2, parallel__ep=4, parallel__zero=3)),
    "pp2-ep2-zero2": (
        4,
        dict(parallel__pp=2, parallel__ep=2, parallel__zero=2, train__microbatches=2, model__router_bias_rate=0.05),
    ),
    "cp2-ep4": (4, dict(parallel__cp=2, parallel__ep=4, parallel__zero=1)),
    "dp2-ep4-overlaps": (4, dict(parallel__dp=2, parallel__ep=4, parallel__ep_overlap=True, parallel__tp_overlap=True)),
    "ep1": (2, dict(parallel__ep=1)),  # whole experts on both tp ranks: partial gradients summed over tp
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_folded_layout_trains_like_one_device(layout):
    world, over = LAYOUTS[layout]
    _verify(world, **over)


def test_expert_groups_span_tp(tmp_path):
    """The mesh's ep and edp groups are the layout's (consecutive dp*cp*tp ranks, tp innermost), and
    a step's all-to-all travels over them."""
    cfg = tiny_config("tiny-moe", parallel__dp=2, parallel__ep=4, train__steps=1, **FOLD)
    layout = Layout.from_config(cfg, 4)
    assert layout.group_ranks("ep", 0) == frozenset(range(4)) and layout.group_ranks("edp", 1) == {1}
    groups = run_on_ranks(4, _mesh_groups, cfg)
    for rank, (ep, edp) in enumerate(groups):
        assert (set(ep), set(edp)) == (layout.group_ranks("ep", rank), layout.group_ranks("edp", rank))
    cfg2 = tiny_config("tiny-moe", parallel__dp=2, parallel__ep=2, train__steps=1, **FOLD)
    layout2 = Layout.from_config(cfg2, 4)
    assert layout2.group_ranks("ep", 2) == {2, 3} and layout2.group_ranks("edp", 1) == {1, 3}
    assert layout2.describe().startswith("dp2 ZeRO-0 tp2+sp ep2 etp1")
    assert "--parallel.etp 1" in layout2.flags(16)


def _mesh_groups(cfg):
    import torch.distributed as dist

    from fived.parallel.mesh import Mesh

    mesh = Mesh.from_config(cfg, dist.get_world_size()).build("cpu", 30)
    return [dist.get_process_group_ranks(mesh.group(name)) for name in ("ep", "edp")]


MOE = dict(model__name="tiny-moe", model__router_bias_rate=0.01, train__steps=4, train__global_batch=8)
RESHARD = {  # (first half's layout, world), (second half's layout, world)
    "folded-zero1-to-unfolded-zero3": (
        (dict(parallel__dp=2, parallel__ep=4, parallel__zero=1, **FOLD), 4),
        (dict(parallel__dp=2, parallel__tp=2, parallel__ep=2, parallel__zero=3), 4),
    ),
    "dp-ep-to-folded-pp": (
        (dict(parallel__dp=4, parallel__ep=4, parallel__zero=2), 4),
        (dict(parallel__pp=2, parallel__ep=2, train__microbatches=2, **FOLD), 4),
    ),
}


@pytest.mark.parametrize("pair", list(RESHARD))
def test_checkpoint_moves_between_folded_and_unfolded(pair):
    (first, world_a), (second, world_b) = RESHARD[pair]
    a, b = tiny_config(**MOE, **first), tiny_config(**MOE, **second)
    report = run_verify(b, world_b, printer=lambda *_: None, reshard_from=(a, world_a))
    assert len(report.rows) == 4
    assert report.max_relative_difference <= EXACT, report.max_rel


REFUSED = [  # (fields, world, the rule's words)
    (dict(parallel__tp=2, parallel__etp=1, parallel__ep=2, parallel__dp=2), 4, "needs sequence parallelism"),
    (dict(parallel__tp=2, parallel__sp=True, parallel__etp=2, parallel__dp=2), 4, "must be 0"),
    (dict(parallel__dp=2, parallel__ep=8, **FOLD), 4, "must divide dp*cp*tp (parallel.etp=1)=4"),
    (dict(parallel__dp=2, parallel__ep=3, **FOLD), 4, "must divide model.n_experts=8"),
    (dict(parallel__dp=2, parallel__ep=2, train__optimizer="muon", **FOLD), 4, "train.optimizer=muon"),
    (dict(model__name="tiny", parallel__dp=2, **FOLD), 4, "needs a mixture-of-experts model"),
]


@pytest.mark.parametrize("over, world, rule", REFUSED, ids=[r[2] for r in REFUSED])
def test_unsupported_folding_is_refused_in_one_line(over, world, rule):
    errors = layout_errors(tiny_config(**{"model__name": "tiny-moe", **over}), world)
    assert errors and isinstance(errors[0], ConfigError), errors
    line = str(errors[0])
    assert rule in line and ";" in line, line  # (the rule broken, then a way out)
    assert line.startswith(("parallel.etp=", "parallel.ep=")) and "\n" not in line, line


def test_folding_without_tp_changes_nothing():
    """etp 1 with tp 1 is the unfolded layout (whole experts already): same groups, same description."""
    plain = Layout(dp=4, ep=2)
    folded = plain.with_(etp=1)
    assert not folded.folded and folded.describe() == plain.describe()
    assert all(folded.group_ranks(g, r) == plain.group_ranks(g, r) for g in ("ep", "edp") for r in range(4))
