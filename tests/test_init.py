"""Initialisation generates only what a rank holds (fived.model.init), and the pieces every layout's ranks
fill assemble into the one-process value bit for bit."""

import math

import pytest
import torch

from fived.layout.placement import Box, Placement
from fived.model.init import TILE_2D, InitStats, TileFiller, TileSeeds, init_value, init_weights, tile_shape
from fived.model.transformer import build_model
from fived.testing import run_on_ranks, tiny_config

EMBEDDING = "tok_embeddings.weight"
BIG = (128256, 4096)  # llama3's embedding
WAYS = 16


def _hull(box: Box, shape) -> int:
    """Elements of the tiles a box touches (what generating it may cost at most)."""
    total = 1
    for o, s, t, g in zip(box.offsets, box.sizes, tile_shape(shape), shape):
        lo, hi = o // t * t, min(-(-(o + s) // t) * t, g)
        total *= hi - lo
    return total


def _fill(placement: Placement, seed=0) -> tuple[torch.Tensor, InitStats]:
    stored = torch.empty(placement.stored_shape)
    filler = TileFiller(TileSeeds({EMBEDDING: BIG}, seed))
    filler.fill(EMBEDDING, BIG, 0.02, placement.pieces(stored))
    return stored, filler.stats


def _cuts(rank: int) -> dict[str, Placement]:
    whole = Box((0, 0), BIG)
    rows, cols = BIG[0] // WAYS, BIG[1] // WAYS
    numel = math.prod(BIG)
    chunk = -(-numel // WAYS)
    shift = 1234  # as if other parameters came first in the rank's flat buffer: ranges start mid-row
    flat = (max(rank * chunk - shift, 0), (rank + 1) * chunk - shift)  # (the last 1234 go to the next rank)
    return {
        "rows": Placement(BIG, Box((rank * rows, 0), (rows, BIG[1]))),  # tp row split / vocab-parallel
        "columns": Placement(BIG, Box((0, rank * cols), (BIG[0], cols))),  # tp column split (wo, w2)
        "zero3-rows": Placement(BIG, whole, rows=(rank * rows, (rank + 1) * rows)),
        "flat-range": Placement(BIG, whole, flat=flat),  # a ZeRO-1/2 optimizer slice
    }


@pytest.mark.parametrize("rank", [0, 7, WAYS - 1])
def test_a_rank_generates_its_share_of_a_big_parameter(rank):
    """A [128256, 4096] parameter cut 16 ways by rows, columns, ZeRO-3 rows and a flat range that
    starts mid-row: the generator work is the rank's 1/16 plus at most the two tile rows (256 x 4096)
    its cut edges cross; the column cut (256 wide, a tile's width) costs nothing extra. No full
    tensor is ever allocated; where two cuts overlap they hold the same values."""
    stored = {}
    for cut, placement in _cuts(rank).items():
        stored[cut], stats = _fill(placement)
        held = stored[cut].numel()
        assert stats.filled == held
        assert held <= -(-math.prod(BIG) // WAYS)
        assert stats.generated <= sum(_hull(box, BIG) for box, _ in placement.pieces(stored[cut]))
        assert stats.generated <= held + 2 * TILE_2D[0] * BIG[1], (cut, stats.generated / held)
        if cut == "columns":
            assert stats.generated == held
        print(f"{cut}: rank {rank} holds {held}, generated {stats.generated} (x{stats.generated / held:.4f})")
    rows, cols = BIG[0] // WAYS, BIG[1] // WAYS
    torch.testing.assert_close(stored["rows"], stored["zero3-rows"], rtol=0, atol=0)
    crossing = stored["columns"][rank * rows : (rank + 1) * rows]
    torch.testing.assert_close(crossing, stored["rows"][:, rank * cols : (rank + 1) * cols], rtol=0, atol=0)
    a = _cuts(rank)["flat-range"].flat[0]
    first_full_row = -(-a // BIG[1])
    local = first_full_row - rank * rows
    if 0 <= local < rows:  # the flat slice's first whole row, where the row cut has it too
        row = stored["flat-range"][first_full_row * BIG[1] - a :][: BIG[1]]
        torch.testing.assert_close(row, stored["rows"][local], rtol=0, atol=0)


def test_small_pieces_assemble_the_whole_value():
    """Uneven boxes, padding past the end, a flat range across rows: the pieces of any cut give the
    one-piece value, and padding stays zero."""
    cfg = tiny_config("tiny").model
    name, shape = "layers.0.feed_forward.w1.weight", (cfg.ffn_dim, cfg.dim)
    full = init_value(name, shape, cfg, 5)
    seeds = TileSeeds({n: tuple(p.shape) for n, p in build_model(cfg).named_parameters()}, 5)
    for placement in (
        Placement(shape, Box((0, 0), (100, 64))),
        Placement(shape, Box((100, 0), (100, 64))),  # runs 44 rows into padding
        Placement(shape, Box((0, 0), shape), flat=(1000, math.prod(shape) - 100)),
        Placement(shape, Box((0, 0), shape), rows=(37, 90)),
    ):
        stored = torch.full(placement.stored_shape, float("nan"))
        if placement.local.sizes[0] + placement.local.offsets[0] > shape[0]:
            stored.zero_()
        pieces = placement.pieces(stored)
        TileFiller(seeds).fill(name, shape, cfg.init_std, pieces)
        for box, view in pieces:
            assert torch.equal(view, full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))])
        assert not stored.isnan().any()


# --- real layouts on gloo ranks ------------------------------------------------------------------


def _init_on_rank(cfg, want_state: bool):
    from fived.training.trainer import Trainer

    trainer = Trainer(cfg, log=False)
    held = hull = 0
    for name in trainer.plan.placements:  # what the parameters hold (ZeRO-1/2: whole until wrapped)
        if name in trainer.plan.global_shapes and "norm" not in name:
            placement = trainer.plan.init_placement(name)
            stored = torch.empty(placement.stored_shape, device="meta")
            pieces = placement.pieces(stored)
            held += sum(box.numel for box, _ in pieces)
            hull += sum(_hull(box, placement.global_shape) for box, _ in pieces)
    state = trainer.plan.full_state() if want_state else None
    return {"stats": trainer.init_stats, "held": held, "hull": hull, "state": state}


def _one_process(cfg) -> dict:
    model = build_model(cfg.model, "cpu", torch.float64)
    init_weights(model, cfg.train.seed)
    return {n: p.detach() for n, p in model.named_parameters()}


def _assert_assembled_equals_one_process(results, cfg):
    want = _one_process(cfg)
    for res in results[:1]:  # (full_state is the same on every rank)
        assert res["state"].keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(res["state"][name], value), name


WIDE = dict(
    model__dim=1024,
    model__n_heads=8,
    model__n_kv_heads=8,
    model__ffn_dim=2048,
    model__vocab_size=1000,
    model__n_layers=1,
)


@pytest.mark.parametrize("zero", [1, 3])
def test_each_rank_generates_only_its_boxes(zero):
    """tp2 x dp2 on 4 gloo ranks, a model wide enough for several 256 x 256 tiles per tensor (dim 1024,
    vocab 1000 = 2 x 500 rows): each rank draws only tiles its pieces touch (at most the sum of their
    tile-aligned hulls) and at most 1.25 x the elements it holds (ZeRO-3: a quarter of most tensors;
    ZeRO-1/2: its tp half, whole until the optimizer slices it); tensors of a few hundred rows cut in
    four round up by up to a tile, big ones by a few percent (the test above). The pieces assemble
    into the one-process values."""
    cfg = tiny_config("tiny", parallel__dp=2, parallel__tp=2, parallel__zero=zero, **WIDE)
    results = run_on_ranks(4, _init_on_rank, cfg, True, timeout_s=120)
    whole = sum(p.numel() for n, p in build_model(cfg.model).named_parameters() if "norm" not in n)
    share = whole / (4 if zero == 3 else 2)
    for rank, res in enumerate(results):
        stats, held = res["stats"], res["held"]
        print(
            f"zero{zero} rank {rank}: holds {held} of {whole}, generated {stats.generated} "
            f"(x{stats.generated / held:.3f}, hull {res['hull']}) in {stats.tiles} tiles"
        )
        assert stats.generated <= res["hull"]
        assert held <= 1.01 * share and stats.generated <= 1.25 * held
    _assert_assembled_equals_one_process(results, cfg)


LAYOUTS = {  # name: (model, world, overrides)
    "tp4-padded-vocab-kv-replicated-tied": (
        "tiny",
        4,
        dict(parallel__tp=4, parallel__dp=1, model__vocab_size=259, model__tie_embeddings=True),
    ),
    "tp2-padded-vocab": ("tiny", 2, dict(parallel__tp=2, parallel__dp=1, model__vocab_size=257)),
    "ep2-dp2": ("tiny-moe", 2, dict(parallel__dp=2, parallel__ep=2, parallel__zero=0)),
    "zero1-dp4": ("tiny-moe", 4, dict(parallel__dp=4, parallel__zero=1)),
    "zero3-dp4-ep2": ("tiny-moe", 4, dict(parallel__dp=4, parallel__zero=3, parallel__ep=2)),
    "pp2-tp2-zero2": (
        "tiny-moe",
        4,
        dict(parallel__pp=2, parallel__tp=2, parallel__dp=1, parallel__zero=2, train__microbatches=2),
    ),
    "pp2-dp2-ep2-zero3": (
        "tiny-moe",
        4,
        dict(parallel__pp=2, parallel__dp=2, parallel__ep=2, parallel__zero=3, train__microbatches=2),
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_init_assembles_to_the_one_process_init(layout):
    model, world, over = LAYOUTS[layout]
    cfg = tiny_config(model, **over)
    results = run_on_ranks(world, _init_on_rank, cfg, True)
    _assert_assembled_equals_one_process(results, cfg)
