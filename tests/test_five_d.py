"""All five dimensions: every pair of dimensions (with a ZeRO stage each) on 4 or 8 ranks, and the
5D layout pp2 x dp2 x cp2 x tp2 with ep4 on 16 ranks, each exact against one device."""

import pytest

from fived.testing import EXACT, tiny_config
from fived.tools.verification import run_verify

PAIRS = {  # name: (world, overrides); ep needs dp*cp ranks to fold over, so (tp|pp, ep) bring dp 2
    "dp-tp": (4, dict(parallel__dp=2, parallel__tp=2, parallel__zero=1)),
    "dp-pp": (4, dict(parallel__dp=2, parallel__pp=2, parallel__zero=2)),
    "dp-cp": (4, dict(parallel__dp=2, parallel__cp=2, parallel__zero=3)),
    "dp-ep": (4, dict(parallel__dp=4, parallel__ep=2, parallel__zero=0)),
    "tp-pp": (4, dict(parallel__dp=1, parallel__tp=2, parallel__pp=2, parallel__zero=0)),
    "tp-cp": (4, dict(parallel__dp=1, parallel__tp=2, parallel__cp=2, parallel__sp=True)),
    "tp-ep": (8, dict(parallel__dp=2, parallel__tp=2, parallel__ep=2, parallel__zero=3, parallel__pp=2)),
    "pp-cp": (4, dict(parallel__dp=1, parallel__pp=2, parallel__cp=2, parallel__zero=0)),
    "pp-ep": (8, dict(parallel__dp=2, parallel__pp=2, parallel__ep=2, parallel__cp=2, parallel__zero=1)),
    "cp-ep": (4, dict(parallel__dp=2, parallel__cp=2, parallel__ep=4, parallel__zero=2)),
}


@pytest.mark.parametrize("pair", PAIRS)
def test_every_pair_of_dimensions(pair):
    world, over = PAIRS[pair]
    cfg = tiny_config("tiny-moe", train__steps=2, train__microbatches=2, **over)
    report = run_verify(cfg, world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel


@pytest.mark.parametrize("zero", [1, 3])
def test_the_5d_layout(zero):
    cfg = tiny_config(
        "tiny-moe",
        parallel__pp=2,
        parallel__dp=2,
        parallel__cp=2,
        parallel__tp=2,
        parallel__ep=4,
        parallel__zero=zero,
        train__steps=2,
        train__microbatches=2,
    )
    report = run_verify(
        cfg,
        16,
        printer=lambda *_: None,
    )
    assert report.max_relative_difference <= EXACT, report.max_rel


EVERY_OVERLAP = dict(
    parallel__tp_overlap=True,
    parallel__overlap_grad_reduce=True,
    parallel__overlap_param_gather=True,
    parallel__ep_overlap=True,
    parallel__bucket_mb=3000 / 2**20,
)  # 3 kB: dozens of buckets


@pytest.mark.parametrize("zero", [1, 2])
def test_every_overlap_switch_on_at_once(zero):
    """tp+sp ring overlap, ZeRO-1/2 bucketed reduce-scatter and all-gather (each pipeline stage
    reducing at its last backward) and the chunked expert all-to-all, all on in one 8-rank layout with
    gradient accumulation: still exact against one device."""
    cfg = tiny_config(
        "tiny-moe",
        parallel__pp=2,
        parallel__dp=2,
        parallel__tp=2,
        parallel__sp=True,
        parallel__ep=2,
        parallel__zero=zero,
        train__steps=2,
        train__microbatches=2,
        **EVERY_OVERLAP,
    )
    report = run_verify(cfg, 8, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel
