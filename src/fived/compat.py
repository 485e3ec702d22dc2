"""Every use of a private torch internal, each behind one function here, so that a torch upgrade
breaks in one module (tests/test_compat.py runs each shim on the installed torch). The versions
fived is tested with are pyproject.toml's `torch` bound; constraints.txt pins the one CI runs."""

from __future__ import annotations

import types

_TORCH_CLASS = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def torch_pipeline_order(schedule: str, pp: int, local_stages: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """rank -> [(kind, stage, micro-batch)]: torch's own per-rank compute order of a multi-stage
    schedule (`Schedule*._calculate_single_rank_operations`, called on a stand-in `self` holding only
    the numbers it reads: constructing a schedule needs real stages and a process group). The
    reference fived.layout.schedule_orders is tested against."""
    from torch.distributed.pipelining import schedules as S

    rounds = max(1, m // pp)
    fake = types.SimpleNamespace(
        pp_group_size=pp,
        n_local_stages=local_stages,
        _n_microbatches=m,
        number_of_rounds=rounds,
        microbatches_per_round=m // rounds,
        num_stages=pp * local_stages,
        _num_stages=pp * local_stages,
    )
    generate = getattr(S, _TORCH_CLASS[schedule])._calculate_single_rank_operations
    kind_of = {id(S.FORWARD): "F", id(S.FULL_BACKWARD): "B", id(S.BACKWARD_INPUT): "I", id(S.BACKWARD_WEIGHT): "W"}
    out = {}
    for rank in range(pp):
        actions = []
        for a in generate(fake, rank):
            if a is None:  # an idle slot of torch's lock-step picture
                continue
            for stage, ctype, mb, _ in a.sub_actions or (a,):  # OVERLAP_F_B runs its F then its B
                kind = kind_of.get(id(ctype))
                if kind is not None:
                    actions.append((kind, stage, mb))
        out[rank] = actions
    return out
