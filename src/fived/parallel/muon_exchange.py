"""Muon's whole matrices from the pieces the ranks store: the runtime of `fived.layout.muon_plan`.

Each step, bucket by bucket (`train.muon_bucket_mb`; the same buckets in the same order on every
rank), given the update direction (Nesterov momentum) of every piece of the bucket's matrices this
rank stores, in the Newton-Schulz dtype:
  1. gather   one all-to-all over the stage group (dp_cp_tp) sends each piece an owner lacks to it;
  2. each owner assembles its units from its own pieces and the received ones, exactly as one device
     holds them, and runs Newton-Schulz on each (the callable the optimizer passes);
  3. scatter  a second all-to-all sends every other holder its pieces of the results;
  4. every piece's orthogonalised values go to the optimizer (`apply`).
A phase in which no rank sends anything (e.g. ZeRO-0 without tp: every owner holds its matrices
whole) is skipped by every rank; a single-rank stage issues no collective.

Extra communication per step and rank (the planner's `fived.planner.communication`, in the
Newton-Schulz dtype's bytes): the pieces it gathers to owners, then the results it scatters to the
other holders of its units, two all-to-alls per bucket. Extra memory, transient, one bucket's, each
let go as soon as it is used: the directions of its pieces, the all-to-alls' buffers, its owned
units assembled and their results (`fived.layout.muon_load.StepLoad.peak`, which the planner prices).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from fived.config import Config
from fived.layout.muon_plan import MemberPlan, StagePlan, stage_plan
from fived.layout.placement import Box, Placement
from fived.layout.stages import rank_chunks
from fived.model.ledger import local_tensor
from fived.parallel import comm
from fived.parallel.mesh import PRECISIONS, Mesh


class MatrixExchange:
    """One rank's part in orthogonalising whole matrices; built with the optimizer, after `wrap`."""

    def __init__(self, mesh: Mesh, cfg: Config, placements: dict[str, Placement]):
        layout = mesh.layout
        self.size = layout.stage_ranks
        pp_rank, self.me = divmod(dist.get_rank(), self.size)
        self.plan: StagePlan = stage_plan(cfg.model, layout, cfg.train.dtype, rank_chunks(cfg.model, layout, pp_rank))
        self.mine: MemberPlan = self.plan.member_plan(self.me)
        self.placements = {name: placements[name] for name in self.plan.names}
        for name, placement in self.placements.items():  # the plan's view of this rank is the runtime's own
            if placement.boxes() != self.mine.placements[name].boxes():
                raise RuntimeError(f"{name}: Muon's plan places {self.mine.placements[name]}, the runtime {placement}")
        self.group = mesh.group("dp_cp_tp") if self.size > 1 else None
        self.dtype = PRECISIONS[cfg.train.dtype].compute  # Newton-Schulz's, and the exchange's
        cuda = mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def fans(self, name: str) -> tuple[int, int]:
        """(fan_out, fan_in) of each matrix of tensor `name`."""
        return self.plan.fans(name)

    def view(self, name: str, stored: torch.Tensor, box: Box) -> torch.Tensor:
        """The elements `box` (of the whole tensor) in `stored`: this rank's storage of tensor `name`,
        or a tensor placed like it (its gradient, its momentum)."""
        for piece, view in self.placements[name].pieces(local_tensor(stored)):
            if box.intersection(piece) == box:
                return view[box.within(piece)]
        raise RuntimeError(f"{name}: {box} is not among this rank's pieces")

    def orthogonalize(
        self,
        direction: Callable[[str, Box], torch.Tensor],
        newton_schulz: Callable[[torch.Tensor], torch.Tensor],
        apply: Callable[[str, Box, torch.Tensor], None],
    ) -> None:
        """`direction(name, box)`: this rank's update direction on `box`, a piece of a matrix of tensor
        `name` it stores (in the Newton-Schulz dtype, shaped like the box); `apply(name, box, values)`
        then gets the orthogonalised whole matrix's values on exactly that piece. Bucket by bucket,
        in the plan's order on every rank: one bucket's buffers are let go before the next's."""
        for bucket in range(len(self.plan.buckets)):
            self._bucket(bucket, direction, newton_schulz, apply)

    def _bucket(self, bucket: int, direction, newton_schulz, apply) -> None:
        units, lists, owned = self.plan.units, self.mine.exchanges[bucket], self.mine.owned[bucket]
        gather, scatter = self.plan.traffic[bucket]
        mine = {
            (u, box): direction(units[u].name, box)
            for u in range(*self.plan.buckets[bucket])
            for box in self.mine.held(u)
        }
        received = defaultdict(list)  # unit -> [(box, values)] gathered here
        for (u, box), values in self._all_to_all(
            lambda u, box: mine[(u, box)], lists.gather_send, lists.gather_recv, gather
        ):
            received[u].append((box, values))
        results = {u: self._orthogonalized(u, mine, received.pop(u, []), newton_schulz) for u in owned}
        mine.clear()  # (the directions and the gathered pieces are let go before the scatter)
        received.clear()
        back = self._all_to_all(
            lambda u, box: results[u][box.within(units[u].box)], lists.scatter_send, lists.scatter_recv, scatter
        )
        for u in owned:  # this rank's pieces of the units it owns, from the results
            for box in self.mine.held(u):
                apply(units[u].name, box, results[u][box.within(units[u].box)])
        for (u, box), values in back:
            apply(units[u].name, box, values.view(box.sizes))

    def _all_to_all(self, values, sends: dict, recvs: dict, active: bool) -> list[tuple[tuple[int, Box], torch.Tensor]]:
        """Send each peer its items (unit, box), `values(unit, box)` each; returns ((unit, box),
        values) received, in the plan's order."""
        if not active or self.group is None:
            return []
        peers = range(self.size)
        parts = [values(u, box).reshape(-1) for peer in peers for u, box in sends.get(peer, ())]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device=self.device)
        del parts
        out_splits = [sum(box.numel for _, box in recvs.get(peer, ())) for peer in peers]
        recv = torch.empty(sum(out_splits), dtype=self.dtype, device=self.device)
        comm.all_to_all_single(
            recv,
            send,
            self.group,
            output_splits=out_splits,
            input_splits=[sum(box.numel for _, box in sends.get(peer, ())) for peer in peers],
            role="optimizer",
        )
        del send
        out, offset = [], 0
        for peer in peers:
            for u, box in recvs.get(peer, ()):
                out.append(((u, box), recv[offset : offset + box.numel]))
                offset += box.numel
        return out

    def _orthogonalized(self, u: int, mine: dict, received: list, newton_schulz) -> torch.Tensor:
        """Unit `u` (owned here) assembled from this rank's pieces and the ones gathered for it
        [(box, values)], exactly as one device holds it, then orthogonalised; shaped like its box of
        the whole tensor."""
        unit = self.plan.units[u]
        whole = torch.empty(unit.box.sizes, dtype=self.dtype, device=self.device)
        for box in self.mine.held(u):
            whole[box.within(unit.box)] = mine[(u, box)]
        for box, values in received:
            whole[box.within(unit.box)] = values.view(box.sizes)
        return newton_schulz(whole.view(unit.rows, unit.cols)).view(unit.box.sizes)
