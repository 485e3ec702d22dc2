"""Multi-rank tests on real gloo ranks: initialisation invariance, data-parallel verification
against the single-process reference, a broken reduction caught, a failing rank reported."""

import pytest
import torch
import torch.distributed as dist

import fived.parallel.ddp
from fived.config import model_preset
from fived.launch.ranks import RankFailed
from fived.model.init import init_weights
from fived.model.transformer import build_model
from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import run_verify


def _reference_params(name: str, seed: int) -> dict:
    model = build_model(model_preset(name), device="cpu")
    init_weights(model, seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded_init(name: str, seed: int) -> dict:
    """Shard on the meta device (FSDP2 over all ranks, plus TP-style Colwise/Rowwise placements on a
    2-d mesh), materialise, init, then gather every parameter whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build_model(model_preset(name))
    for block in model.layers.values():
        parallelize_module(
            block.attention,
            mesh["tp"],
            {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()},
        )
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    init_weights(model, seed)
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"params": full, "local_numel": local_numel}


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_sharded_init_is_bit_identical_to_single_rank(name):
    results = run_on_ranks(4, _sharded_init, name, 7)
    want = _reference_params(name, 7)
    total = sum(p.numel() for p in want.values())
    for res in results:
        assert res["local_numel"] < total  # really sharded: no rank holds the whole model
        assert res["params"].keys() == want.keys()
        for n, p in want.items():
            assert torch.equal(res["params"][n], p), n


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("micro", [1, 2])
def test_data_parallel_matches_reference(name, micro):
    cfg = tiny_config(name, parallel__dp=2, train__microbatches=micro)
    report = run_verify(cfg, 2, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel
    assert len(report.rows) == cfg.train.steps  # every step was compared
    assert set(report.max_rel) >= {"loss", "grad_norm", "params"}


class _Done:
    def wait(self):
        pass


def _skip_reduction(buffer, group, reduce_dtype):
    """A broken data-parallel reduction: each rank keeps its own gradients."""
    return _Done(), buffer


def _average(buffer, group, reduce_dtype):
    """A broken reduction: averages (torch DDP's default) where the loss scaling requires a sum."""
    dist.all_reduce(buffer, group=group)
    buffer /= dist.get_world_size(group)
    return _Done(), buffer


@pytest.mark.parametrize("broken", [_skip_reduction, _average])
def test_verify_catches_a_broken_reduction(broken, monkeypatch, capsys):
    """Ranks are forked, so they inherit the patched reduction; verify must fail loudly."""
    from fived.cli.main import main

    monkeypatch.setattr(fived.parallel.ddp, "reduce_bucket", broken)
    assert main(["verify", "--dp", "2", "--steps", "3", "--seq-len", "32", "--global-batch", "8"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("max relative difference: ")
    assert float(last.split(": ")[1]) > 1e-6


def test_a_failing_rank_fails_fast():
    def body():
        if dist.get_rank() == 1:
            raise RuntimeError("rank one fails")
        dist.barrier()  # rank 0 would wait here until the timeout without the launcher's kill

    with pytest.raises(RankFailed, match="rank one fails"):
        run_on_ranks(2, body, timeout_s=30)


def test_a_rendezvous_port_taken_before_it_is_bound_is_tried_again(monkeypatch):
    """Another process may take the chosen port before rank 0 binds it (many runs on one machine):
    nothing has run yet, so the launcher tries another port instead of failing."""
    import contextlib
    import socket

    from fived.launch import ranks as launch

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        reserved = launch._reserved_port

        @contextlib.contextmanager
        def taken_first():
            if ports:
                yield ports.pop()
            else:
                with reserved() as port:
                    yield port

        monkeypatch.setattr(launch, "_reserved_port", taken_first)

        def body():
            dist.barrier()
            return dist.get_rank()

        assert run_on_ranks(2, body, timeout_s=30) == [0, 1]
        assert not ports  # (the taken port was handed out first)


def test_ranks_leave_the_objects_they_inherit_to_the_parent():
    """The launcher forks ranks with this process's objects frozen (gc.freeze): a rank's garbage
    collections walk (and so copy-on-write) only the objects it makes; the parent collects its own
    again as before once the ranks exist."""
    import gc

    frozen_in_rank = run_on_ranks(1, gc.get_freeze_count)[0]
    assert frozen_in_rank > 10_000  # (a pytest session with torch imported holds ~300,000)
    assert gc.get_freeze_count() == 0


def test_the_rendezvous_port_is_held_until_rank_0s_store_listens_on_it():
    """Between choosing the port and rank 0 binding it, no other process can get it (a second
    launcher's ranks would join this run's store): the launcher holds it bound, and the store can
    still listen on it."""
    import datetime
    import errno
    import socket

    from fived.launch import ranks as launch

    with launch._reserved_port() as port:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        handed_out = set()
        for _ in range(2000):
            with socket.socket() as other:
                other.bind(("127.0.0.1", 0))
                handed_out.add(other.getsockname()[1])
        assert port not in handed_out
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
        store.set("k", "v")
        assert store.get("k") == b"v"


def _peak_on_a_rank():
    import torch.distributed as dist

    from fived.training import trainer

    trainer.host_peak_tflops.cache_clear()  # (the session's reading, inherited: gone, so a rank must time)
    rank, world = dist.get_rank(), dist.get_world_size()
    peak = trainer.shared_peak_tflops(torch.float64, 0.0, torch.device("cpu"), rank, world)
    return peak, trainer.host_peak_tflops.cache_info().misses


def test_cpu_ranks_time_the_matmul_once_and_share_its_peak():
    """MFU's peak on CPU ranks: rank 0 times the host's matmul, every rank gets its figure."""
    results = run_on_ranks(3, _peak_on_a_rank)
    assert [misses for _, misses in results] == [1, 0, 0]
    assert results[0][0] > 0 and len({peak for peak, _ in results}) == 1
