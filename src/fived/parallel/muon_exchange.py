"""Muon's whole matrices from the pieces the ranks store: the runtime of `fived.muon_plan`.

Each step, given the update direction (Nesterov momentum) of every piece of a Muon tensor this rank
stores, in the Newton-Schulz dtype:
  1. gather   one all-to-all over the stage group (dp_cp_tp) sends each piece an owner lacks to it;
  2. each owner assembles its units from its own pieces and the received ones, exactly as one device
     holds them, and runs Newton-Schulz on each (the callable the optimizer passes);
  3. scatter  a second all-to-all sends every other holder its pieces of the results.
What comes back is, per Muon tensor this rank stores, the orthogonalised direction of exactly its
stored elements. A phase in which no rank sends anything (e.g. ZeRO-0 without tp: every owner holds
its matrices whole) is skipped by every rank; a single-rank stage issues no collective.

Extra communication per step and rank (the planner's `fived.planner.communication`, in the
Newton-Schulz dtype's bytes): the pieces it gathers to owners, then the results it scatters to the
other holders of its units. Extra memory, transient: the directions and results of its stored
pieces, the send and receive buffers, and its owned units assembled (`fived.planner.memory`).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist

from fived import comm
from fived.config import Config
from fived.layout.stages import rank_chunks
from fived.ledger import local_tensor
from fived.mesh import PRECISIONS, Mesh
from fived.muon_plan import StagePlan, stage_plan
from fived.placement import Box, Placement


class MatrixExchange:
    """One rank's part in orthogonalising whole matrices; built with the optimizer, after `wrap`."""

    def __init__(self, mesh: Mesh, cfg: Config, placements: dict[str, Placement]):
        layout = mesh.layout
        size = layout.dp * layout.cp * layout.tp
        pp_rank, self.me = divmod(dist.get_rank(), size)
        self.plan: StagePlan = stage_plan(cfg.model, layout, cfg.train.dtype, rank_chunks(cfg.model, layout, pp_rank))
        self.lists = self.plan.exchange(self.me)
        self.placements = {name: placements[name] for name in self.plan.names}
        for name, placement in self.placements.items():  # the plan's view of this rank is the runtime's own
            if placement.boxes() != self.plan.placements[self.me][name].boxes():
                raise RuntimeError(f"{name}: Muon's plan places {self.plan.placements[self.me][name]}, "
                                   f"the runtime {placement}")
        self.group = mesh.group("dp_cp_tp") if size > 1 else None
        self.dtype = PRECISIONS[cfg.train.dtype].compute  # Newton-Schulz's, and the exchange's
        cuda = mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.owned = [u for u, unit in enumerate(self.plan.units) if unit.owner == self.me]

    def fans(self, name: str) -> tuple[int, int]:
        """(fan_out, fan_in) of each matrix of tensor `name`."""
        return next(unit.fans for unit in self.plan.units if unit.name == name)

    def orthogonalize(self, directions: dict[str, torch.Tensor],
                      newton_schulz: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """`directions`: for every Muon tensor this rank stores a piece of, that piece's direction
        (shaped like the stored parameter, local). Returns the orthogonalised whole matrices' values
        on exactly those elements, in the Newton-Schulz dtype."""
        mine = {name: self.placements[name].pieces(local_tensor(t).to(self.dtype)) for name, t in directions.items()}
        gather, scatter = self.plan.traffic
        received = defaultdict(list)  # unit -> [(box, values)] gathered here
        for (u, box), values in self._all_to_all(lambda u, box: _values(mine, self.plan.units[u].name, box),
                                                 self.lists.gather_send, self.lists.gather_recv, gather):
            received[u].append((box, values))
        results = {u: self._orthogonalized(u, mine, received[u], newton_schulz) for u in self.owned}
        del received
        out = {name: torch.zeros(t.shape, dtype=self.dtype, device=self.device) for name, t in directions.items()}
        pieces = {name: self.placements[name].pieces(update) for name, update in out.items()}
        for u in self.owned:  # this rank's pieces of the units it owns, from the results
            unit = self.plan.units[u]
            for box, view in pieces.get(unit.name, []):
                part = box.intersection(unit.box)
                if part is not None:
                    view[part.within(box)] = results[u][part.within(unit.box)]
        back = self._all_to_all(lambda u, box: results[u][box.within(self.plan.units[u].box)],
                                self.lists.scatter_send, self.lists.scatter_recv, scatter)
        for (u, box), values in back:
            _values(pieces, self.plan.units[u].name, box).copy_(values.view(box.sizes))
        return out

    def _all_to_all(self, values, sends, recvs, active: bool) -> list[tuple[tuple[int, Box], torch.Tensor]]:
        """Send each peer its items (unit, box), `values(unit, box)` each; returns ((unit, box),
        values) received, in the plan's order."""
        if not active or self.group is None:
            return []
        flats = [torch.cat([values(u, box).reshape(-1) for u, box in items]) if items else
                 torch.empty(0, dtype=self.dtype, device=self.device) for items in sends]
        send = torch.cat(flats)
        out_splits = [sum(box.numel for _, box in items) for items in recvs]
        recv = torch.empty(sum(out_splits), dtype=self.dtype, device=self.device)
        comm.all_to_all_single(recv, send, self.group, output_splits=out_splits,
                               input_splits=[f.numel() for f in flats], role="optimizer")
        out, offset = [], 0
        for items in recvs:
            for u, box in items:
                out.append(((u, box), recv[offset:offset + box.numel]))
                offset += box.numel
        return out

    def _orthogonalized(self, u: int, mine, received: list, newton_schulz) -> torch.Tensor:
        """Unit `u` (owned here) assembled from this rank's pieces and the ones gathered for it
        [(box, values)], exactly as one device holds it, then orthogonalised; shaped like its box of
        the whole tensor."""
        unit = self.plan.units[u]
        whole = torch.empty(unit.box.sizes, dtype=self.dtype, device=self.device)
        for piece, view in mine.get(unit.name, []):
            part = piece.intersection(unit.box)
            if part is not None:
                whole[part.within(unit.box)] = view[part.within(piece)]
        for box, values in received:
            whole[box.within(unit.box)] = values.view(box.sizes)
        return newton_schulz(whole.view(unit.rows, unit.cols)).view(unit.box.sizes)


def _values(pieces: dict[str, list[tuple[Box, torch.Tensor]]], name: str, box: Box) -> torch.Tensor:
    """The elements of `box` in this rank's pieces (box, view) of tensor `name`."""
    for piece, view in pieces[name]:
        if box.intersection(piece) == box:
            return view[box.within(piece)]
    raise RuntimeError(f"{name}: {box} is not among this rank's pieces")
