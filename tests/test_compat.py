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


def test_mesh_shims_on_a_fake_process_group():
    """flatten_mesh, dtensor_local_box and fake_store (the dry run's process group), as rank 1 of 4."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fived.compat import dtensor_local_box, flatten_mesh
    from fived.tools.dryrun import fake_process_group

    with fake_process_group(rank=1, world=4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        flat = flatten_mesh(mesh, "ab")
        assert flat.mesh.tolist() == [0, 1, 2, 3] and flat.get_local_rank() == 1
        assert dtensor_local_box((8, 6), mesh, [Shard(0), Shard(1)]) == ((4, 3), (0, 3))  # coordinates (0, 1)


def test_process_group_options_carry_the_timeout():
    import datetime

    from fived.compat import process_group_options

    backend, options = process_group_options("cpu", 7.5)
    assert backend == "gloo" and options._timeout == datetime.timedelta(seconds=7.5)


def test_in_backward_tells_backward_from_forward():
    import torch

    from fived.compat import in_backward

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(in_backward())
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(in_backward())
            return grad * 2

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [False, True] and not in_backward()


def test_schedule_stages_of_single_and_multi_stage_schedules():
    import torch
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

    from fived.compat import schedule_stages
    from fived.tools.dryrun import fake_process_group

    with fake_process_group(rank=0, world=2):
        stages = [PipelineStage(torch.nn.Linear(2, 2), s, 4, torch.device("cpu")) for s in (0, 2)]
        assert schedule_stages(ScheduleInterleaved1F1B(stages, n_microbatches=2)) == stages
        single = PipelineStage(torch.nn.Linear(2, 2), 0, 2, torch.device("cpu"))
        assert schedule_stages(ScheduleGPipe(single, n_microbatches=2)) == [single]


def test_checkpoint_wrapper_and_its_inner_module():
    import torch

    from fived.compat import checkpoint_wrapper, checkpointed_inner

    inner = torch.nn.Linear(3, 3)
    wrapped = checkpoint_wrapper(inner, preserve_rng_state=False)
    assert checkpointed_inner(wrapped) is inner and checkpointed_inner(inner) is None
    x = torch.randn(2, 3)
    wrapped(x).sum().backward()
    assert inner.weight.grad is not None and torch.equal(wrapped(x), inner(x))


def test_grouped_mm_is_one_gemm_per_group():
    import torch

    from fived.compat import grouped_mm, has_grouped_mm

    assert has_grouped_mm()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 16, generator=gen).bfloat16()
    w = torch.randn(3, 16, 32, generator=gen).bfloat16()
    ends = [16, 16, 48]  # (an empty group too)
    out = grouped_mm(x, w, torch.tensor(ends, dtype=torch.int32))
    starts = [0, *ends[:-1]]
    want = torch.cat([x[s:e].float() @ w[g].float() for g, (s, e) in enumerate(zip(starts, ends))])
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-1)


def _groups_and_event_loops():
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    groups = [dist.new_group([0, 1]) for _ in range(3)]
    sums = []
    for group in groups:
        value = torch.full((2,), float(dist.get_rank() + 1))
        dist.all_reduce(value, group=group)
        sums.append(value.tolist())
    threads = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    backend = groups[0]._get_backend(torch.device("cpu"))
    return sums, threads.count("gloo_tcp_loop"), isinstance(backend, c10d.ProcessGroupGloo)


def test_gloo_groups_share_one_device():
    """gloo_groups_on_one_device (the launcher's CPU ranks have it): four groups (the default and
    three new ones) sum correctly through one event-loop thread, not four, and torch's isinstance
    checks still recognise its groups."""
    from fived.testing import run_on_ranks

    for sums, loops, recognised in run_on_ranks(2, _groups_and_event_loops):
        assert sums == [[3.0, 3.0]] * 3 and loops == 1 and recognised


def _mesh_outlives_its_run():
    import gc
    import weakref

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fived.compat import forget_dtensor_meshes

    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    total = (x * 2).redistribute(mesh, [Replicate()]).to_local().sum().item()
    held = weakref.ref(mesh)
    del mesh, x
    gc.collect()
    kept = held() is not None
    forget_dtensor_meshes()
    gc.collect()
    return total, kept, held() is not None


def test_forget_dtensor_meshes():
    """forget_dtensor_meshes: DTensor's caches keep a mesh (and its groups) after its last use; once
    they are emptied, nothing does."""
    from fived.testing import run_on_ranks

    for total, kept, still in run_on_ranks(2, _mesh_outlives_its_run):
        assert total == 240.0 and kept and not still
