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


def flatten_mesh(mesh, name: str, backend_override=None):
    """One DeviceMesh dimension spanning several of `mesh`'s (`DeviceMesh._flatten`: a sub-mesh
    over the product of the dimensions, with its own process group), named `name`."""
    return mesh._flatten(name, backend_override=backend_override)


def process_group_options(device_type: str, timeout_s: float):
    """(backend, options) whose collectives time out after `timeout_s` seconds, for DeviceMesh's
    backend_override (gloo's options class is `ProcessGroupGloo._Options`, its timeout `_timeout`)."""
    import datetime

    import torch.distributed as dist

    if device_type == "cuda":
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return backend, options


def gloo_groups_on_one_device(hostname: str) -> None:
    """Every gloo process group this process creates from now on shares one transport device on
    `hostname`: torch's new_group (and init_process_group) build each group as
    `distributed_c10d.ProcessGroupGloo(store, rank, size, timeout=...)`, a device of its own per group,
    and each device runs an event-loop thread that wakes about 100 times a second, idle or not; with
    the dozen groups of a 5-D mesh on every rank of a 2-core machine that is a measurable share of the
    CPU (kernel time: epoll waits and task switches). Here that name is a subclass passing one device
    in `_Options._devices` (gloo connects the pairs of any number of groups through one device)."""
    import datetime
    import os

    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d.ProcessGroupGloo, "device_pid", None) == os.getpid():
        return
    # (torch's class; a process forked from one that set this up needs a device of its own: the
    # parent's event-loop thread does not exist in it)
    torchs = getattr(c10d.ProcessGroupGloo, "torchs", c10d.ProcessGroupGloo)
    device = torchs.create_device(hostname=hostname)

    class _AlsoTorchs(type(torchs)):  # type: ignore[misc]  # (pybind11's metaclass)
        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, torchs)  # (groups torch hands back as its own class still count)

    class OneDeviceGloo(torchs, metaclass=_AlsoTorchs):  # type: ignore[misc, valid-type]
        device_pid = os.getpid()

        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            options = torchs._Options()
            options._devices = [device]
            options._timeout = timeout
            options._threads = 2  # (torch's own count per device)
            super().__init__(store, rank, size, options)

    OneDeviceGloo.torchs = torchs
    c10d.ProcessGroupGloo = OneDeviceGloo  # type: ignore[misc]


def forget_dtensor_meshes() -> None:
    """Empty DTensor's caches keyed by device meshes: sharding propagation (this thread's Python cache,
    `torch.distributed.tensor.debug._clear_sharding_prop_cache`, and the C++ fast path's), the tensor
    metadata of its ops, redistribution plans and planners (`_redistribute._gen_transform_infos`,
    `_redistribute.clear_redistribute_planner_cache`) and mesh topologies
    (`MeshTopoInfo.build_from_mesh`). Their entries hold the meshes of every run this process
    trained, and each mesh its process groups, alive; and DeviceMesh equality ignores the groups, so a
    later mesh over the same ranks would be handed specs of a destroyed one."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (`torch._C._current_graph_task_id`)."""
    import torch

    return torch._C._current_graph_task_id() != -1


def schedule_stages(schedule) -> list:
    """The PipelineStages this rank's pipeline schedule runs (`_stages` of a multi-stage schedule,
    `_stage` of a single-stage one)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def fake_store():
    """The store of torch's "fake" process group backend (every collective a no-op), which lives in
    `torch.testing._internal`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def dtensor_local_box(shape, device_mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of a DTensor of `shape`
    (`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, device_mesh, placements)
    return tuple(local), tuple(offset)


def checkpoint_wrapper(module, **kwargs):
    """`module` with activation checkpointing (torch.distributed.algorithms._checkpoint's wrapper,
    which torchtitan uses too)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


def checkpointed_inner(module):
    """The module a checkpoint_wrapper wraps (its `_checkpoint_wrapped_module`), or None."""
    return getattr(module, "_checkpoint_wrapped_module", None)


def has_grouped_mm() -> bool:
    """Whether this torch has the grouped GEMM kernel (`torch._grouped_mm`)."""
    import torch

    return hasattr(torch, "_grouped_mm")


def grouped_mm(a, b, offs):
    """One GEMM per group of rows of `a` (group g ends at row offs[g]) with b[g] (`torch._grouped_mm`,
    the kernel torchtitan's experts use; it wants bf16 and 16-byte aligned strides)."""
    import torch

    return torch._grouped_mm(a, b, offs=offs)
