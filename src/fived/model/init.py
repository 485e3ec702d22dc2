"""Initial values, generated tile by tile so that a rank makes only what it holds.

Every parameter is cut into fixed tiles of its whole (unpadded) tensor: 256 x 256 over the last two
dimensions, one index at a time over leading ones (an expert), 64K elements of a 1-d tensor. Each
tile has a generator of its own, seeded from (seed, canonical name, tile index), so a value depends
on its position in the whole tensor and never on the layout. A rank walks the boxes its storage
covers (`Placement.pieces`), draws each tile they touch once into a reused buffer and copies the
intersections straight into the parameter: its work is its share plus the tiles its box edges cut
(tensor-parallel column splits of 256-multiples and ZeRO-3 row chunks cost at most one partial tile
row or column per edge). The same path with the whole tensor as the box gives the one-device value.

Seeds: torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, and a model has
millions of tiles (llama3-405b: ~6M), so a hash per tile would give some tiles the same values (about
n^2 / 2^33 pairs: thousands). Instead every tile of the model is numbered (parameters in sorted
order, tiles in row-major order of their grid) and mapped to a seed by an odd multiplier plus a hash
of the run's seed: a bijection of 32-bit numbers, so no two tiles of one model share a seed. The
numbering reads the model's parameter shapes (its config), which every rank knows.

Std rules: norms 1 (0 with model.norm_offset: they scale by 1 + weight), residual-branch outputs (attention.wo, w2, experts' w2) init_std / sqrt(2 L),
everything else init_std; buffers (router biases) 0; padding (a vocabulary padded for tp) 0.
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from fived.layout.placement import Box, Placement
from fived.layout.spec import tensor_specs
from fived.model.transformer import canonical_name, find_config

TILE_2D = (256, 256)  # over a tensor's last two dimensions (leading dimensions: one index per tile)
TILE_1D = 65536
TILE_NUMEL = max(math.prod(TILE_2D), TILE_1D)
_MULTIPLIER = 0x9E3779B1  # odd: multiplication by it permutes the 32-bit numbers


@dataclass
class InitStats:
    """What an initialisation did on this rank."""

    generated: int = 0  # normal samples drawn (whole tiles: the generator work)
    filled: int = 0  # parameter elements written from those (held pieces, padding not counted)
    tiles: int = 0


def tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (TILE_1D,)
    return (1,) * (len(shape) - 2) + TILE_2D


def _grid(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-g // t) for g, t in zip(shape, tile_shape(shape)))


class TileSeeds:
    """The seed of every tile of a model's parameters (see the module docstring)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int):
        self.first, total = {}, 0
        for name in sorted(shapes):
            self.first[name] = total
            total += math.prod(_grid(tuple(shapes[name])))
        if total > 2**32:
            raise ValueError(f"{total} tiles: more than 32-bit seeds can tell apart")
        self.offset = zlib.crc32(f"fived-init/{seed}".encode())

    def __call__(self, name: str, tile: int) -> int:
        return (_MULTIPLIER * (self.first[name] + tile) + self.offset) % 2**32


def std_of(name: str, cfg) -> float | None:
    """The normal's std for parameter `name`; None for a norm's weight (a constant: `norm_start`)."""
    if "norm" in name:
        return None
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith(("attention.wo.weight", "w2.weight")) or (".experts." in name and leaf == "w2"):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)  # residual-branch outputs, GPT-2 style
    return cfg.init_std


def norm_start(cfg) -> float:
    """A norm weight's initial value: the identity scale (1, or 0 where norms scale by 1 + weight)."""
    return 0.0 if cfg.norm_offset else 1.0


class TileFiller:
    """Draws tiles into one reused buffer and copies them into pieces; counts its work."""

    def __init__(self, seeds: TileSeeds, stats: InitStats | None = None):
        self.seeds, self.stats = seeds, stats if stats is not None else InitStats()
        self.buffer = torch.empty(TILE_NUMEL)
        self.generator = torch.Generator()

    @torch.no_grad()
    def fill(
        self,
        name: str,
        shape: tuple[int, ...],
        std: float | None,
        pieces: list[tuple[Box, torch.Tensor]],
        *,
        constant: float = 1.0,
    ) -> None:
        """Write parameter `name`'s initial values into `pieces` ((box of the whole tensor of `shape`,
        view) pairs, e.g. `Placement.pieces(stored)`), drawing each touched tile once; std None:
        `constant` everywhere."""
        shape = tuple(shape)
        if std is None:
            for box, view in pieces:
                view.fill_(constant)
                self.stats.filled += box.numel
            return
        tile, grid = tile_shape(shape), _grid(shape)
        wanted: dict[tuple[int, ...], list[int]] = {}
        for i, (box, _) in enumerate(pieces):
            if box.numel == 0:
                continue
            spans = [range(o // t, (o + s - 1) // t + 1) for o, s, t in zip(box.offsets, box.sizes, tile)]
            for coords in itertools.product(*spans):
                wanted.setdefault(coords, []).append(i)
        for coords, users in wanted.items():
            origin = tuple(c * t for c, t in zip(coords, tile))
            sizes = tuple(min(t, g - o) for t, g, o in zip(tile, shape, origin))
            values = self.buffer[: math.prod(sizes)].view(sizes)
            index = sum(c * math.prod(grid[d + 1 :]) for d, c in enumerate(coords))
            self.generator.manual_seed(self.seeds(name, index))
            values.normal_(0.0, std, generator=self.generator)
            self.stats.generated += values.numel()
            self.stats.tiles += 1
            for i in users:
                box, view = pieces[i]
                lo = [max(o, b) for o, b in zip(origin, box.offsets)]
                hi = [min(o + s, b + n) for o, s, b, n in zip(origin, sizes, box.offsets, box.sizes)]
                into = tuple(slice(a - b, z - b) for a, z, b in zip(lo, hi, box.offsets))
                src = tuple(slice(a - o, z - o) for a, z, o in zip(lo, hi, origin))
                view[into].copy_(values[src])
                self.stats.filled += math.prod(z - a for a, z in zip(lo, hi))


def model_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every parameter's whole shape by canonical name, from the sharding spec."""
    return {name: spec.shape for name, spec in tensor_specs(cfg).items() if not spec.buffer}


def init_value(name: str, shape: torch.Size, cfg, seed: int) -> torch.Tensor:
    """The whole initial value of parameter `name` (float32, CPU), for code that needs one."""
    shapes = model_shapes(cfg)
    if tuple(shapes[name]) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(shape)}, the model's is {shapes[name]}")
    full = torch.empty(tuple(shape))
    whole = Placement(tuple(shape), Box((0,) * len(shape), tuple(shape)))
    filler = TileFiller(TileSeeds(shapes, seed))
    filler.fill(name, tuple(shape), std_of(name, cfg), whole.pieces(full), constant=norm_start(cfg))
    return full


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, placement_of=None, stats: InitStats | None = None) -> InitStats:
    """Fill (already materialised) parameters with their initial values; returns what was generated.

    `placement_of(name)`: where this rank's storage of parameter `name` sits in the whole tensor
    (its `Placement`, as the parameter holds it at initialisation). Without it a plain tensor is the
    whole parameter and a DTensor's shard is located by its own placements."""
    cfg = find_config(model)
    shapes = model_shapes(cfg)
    filler = TileFiller(TileSeeds(shapes, seed), stats)
    for raw, param in model.named_parameters():
        name = canonical_name(raw)
        shape = shapes[name]
        placement = placement_of(name) if placement_of is not None else _own_placement(param, shape)
        stored = param.to_local() if hasattr(param, "to_local") else param
        pieces = placement.pieces(stored)
        if sum(box.numel for box, _ in pieces) < stored.numel():
            stored.zero_()  # padding (and any storage no piece covers) stays zero
        filler.fill(name, shape, std_of(name, cfg), pieces, constant=norm_start(cfg))
    for _, buffer in model.named_buffers():  # (router biases start at zero)
        buffer.zero_()
    return filler.stats


def _own_placement(param: torch.Tensor, shape: tuple[int, ...]) -> Placement:
    """A parameter without a placement table: the whole tensor, or a DTensor's shard."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        if tuple(param.shape) != tuple(shape):
            raise ValueError(f"parameter of shape {tuple(param.shape)}, the model's is {tuple(shape)}")
        return Placement(tuple(shape), Box((0,) * len(shape), tuple(shape)))
    from fived.compat import dtensor_local_box

    local_shape, offsets = dtensor_local_box(param.shape, param.device_mesh, param.placements)
    if local_shape != tuple(param.to_local().shape):
        raise ValueError(f"cannot locate a DTensor shard of shape {tuple(param.to_local().shape)}")
    return Placement(tuple(shape), Box(offsets, local_shape))
