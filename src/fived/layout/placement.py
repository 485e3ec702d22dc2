"""One placement description per tensor: where this rank's piece of each parameter (and buffer)
sits in the whole tensor, as one device would hold it.

Megatron-Core's `ShardedTensor` idea, for fived's recipe. Every parallel dimension cuts a parameter
in one of three ways, and a `Placement` records all three:
  - the model-local tensor (after tensor and expert parallelism) is a box of the whole tensor,
    possibly running into padding (a vocabulary padded to a multiple of tp): the sharding spec's
    box for this rank (`fived.layout.spec.TensorSpec.local_box`);
  - data parallelism then stores either all of it, or rows [a, b) of it (ZeRO-3: FSDP2 shards the
    first dimension), or elements [a, b) of its flat view (ZeRO-1/2: a slice of the flat buffer);
  - ranks that hold the same piece are replicas; only replica 0's copy is saved.
Initialisation (`fived.model.init`: each rank draws only its pieces' tiles), `full_state()`, checkpoints,
`--init-from` and export read this table; an optimizer moment is placed exactly like the parameter
it belongs to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (plain Python otherwise: the layout core and the planner read placements too)
    import torch


@dataclass(frozen=True)
class Box:
    """A rectangular region of a whole tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersection(self, other: Box) -> Box | None:
        """The region both boxes cover (None: they do not meet)."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """This box as slices of a tensor holding `outer` (which contains it)."""
        return tuple(slice(o - p, o - p + s) for o, s, p in zip(self.offsets, self.sizes, outer.offsets))


@dataclass(frozen=True)
class Placement:
    global_shape: tuple[int, ...]  # the whole tensor, without padding
    local: Box  # the model-local tensor (after tp / ep) in the (padded) whole tensor
    replica: int = 0  # 0: this rank's copy is the one written; > 0: another rank's piece again
    rows: tuple[int, int] | None = None  # ZeRO-3: rows [a, b) of the local tensor are stored here
    flat: tuple[int, int] | None = None  # ZeRO-1/2: elements [a, b) of the local tensor's flat view

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the tensor data parallelism stores here (the flat slice is 1-D)."""
        if self.flat is not None:
            return (self.flat[1] - self.flat[0],)
        if self.rows is not None:
            return (self.rows[1] - self.rows[0],) + self.local.sizes[1:]
        return self.local.sizes

    def pieces(self, stored: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
        """`stored` (a tensor of `stored_shape`: the parameter's storage, or an optimizer moment
        placed like it) cut into boxes of the whole tensor, as views; padding is left out."""
        if tuple(stored.shape) != self.stored_shape:
            raise ValueError(f"stored tensor of shape {tuple(stored.shape)}, placement says {self.stored_shape}")
        out = []
        for whole, box, start in self._placed():
            view = stored if start is None else stored[start : start + box.numel].view(box.sizes)
            for dim, (want, have) in enumerate(zip(whole.sizes, box.sizes)):
                if want != have:
                    view = view.narrow(dim, 0, want)
            out.append((whole, view))
        return out

    def boxes(self) -> list[Box]:
        """The boxes of the whole tensor `pieces` cuts, in its order (no tensor needed)."""
        return [whole for whole, _, _ in self._placed()]

    def _placed(self):
        """(box of the whole tensor, box of the model-local tensor, where that box starts in the stored
        tensor's flat view; None: it is the whole stored tensor) per piece, clipped to the real size."""
        if self.flat is not None:
            parts = [(box, start - self.flat[0]) for box, start in flat_boxes(self.local.sizes, *self.flat)]
        elif self.rows is not None:
            parts = [(Box((self.rows[0],) + (0,) * (len(self.local.sizes) - 1), self.stored_shape), None)]
        else:
            parts = [(Box((0,) * len(self.local.sizes), self.local.sizes), None)]
        for box, start in parts:  # local coordinates -> whole-tensor coordinates, clipped to the real size
            offsets = tuple(o + lo for o, lo in zip(box.offsets, self.local.offsets))
            ends = tuple(min(o + s, g) for o, s, g in zip(offsets, box.sizes, self.global_shape))
            sizes = tuple(max(e - o, 0) for o, e in zip(offsets, ends))
            if math.prod(sizes) == 0 and len(sizes):
                continue
            yield Box(offsets, sizes), box, start

    @property
    def holds_origin(self) -> bool:
        """Whether this rank writes the parameter's scalars (AdamW's step): the saved copy of the
        piece that starts at the whole tensor's first element."""
        if self.replica != 0 or any(self.local.offsets):
            return False
        if self.rows is not None:
            return self.rows[0] == 0 and self.rows[1] > 0
        return self.flat is None or (self.flat[0] == 0 and self.flat[1] > 0)


def flat_boxes(shape: tuple[int, ...], a: int, b: int):
    """Elements [a, b) of the flat view of a C-contiguous tensor of `shape`, as boxes that are each
    contiguous in memory: yields (box in the tensor's coordinates, flat index of its first element)."""
    if a >= b:
        return
    if not shape:
        yield Box((), ()), 0
        return
    inner = math.prod(shape[1:])
    first, head = divmod(a, inner)
    last, tail = divmod(b, inner)
    if first == last:  # inside one slice of the first dimension
        for box, start in flat_boxes(shape[1:], head, tail):
            yield _prefixed(box, first), first * inner + start
        return
    if head:
        for box, start in flat_boxes(shape[1:], head, inner):
            yield _prefixed(box, first), first * inner + start
        first += 1
    if last > first:
        yield Box((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])), first * inner
    if tail:
        for box, start in flat_boxes(shape[1:], 0, tail):
            yield _prefixed(box, last), last * inner + start


def _prefixed(box: Box, index: int) -> Box:
    return Box((index,) + box.offsets, (1,) + box.sizes)
