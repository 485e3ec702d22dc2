"""`fived calibrate` writes a machine profile; the planner reads it back and prices with its numbers."""

import copy
import json
import time

import pytest
import torch

from fived.cli.main import main
from fived.config import ConfigError, build_config
from fived.layout.layout import Layout
from fived.planner.constants import CALIBRATION
from fived.planner.hardware import hardware
from fived.planner.links import collective_seconds, group_link
from fived.planner.profile import profile_hardware, read_profile, write_profile
from fived.planner.timing import Cluster, step_time
from fived.tools.calibrate import calibrate


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """A quick calibration on 2 ranks: (its path, its contents)."""
    path = tmp_path_factory.mktemp("calibrate") / "machine.json"
    doc = calibrate(str(path), nproc=2, minutes=0.1, quick=True)
    return path, doc


def _step(path, world=2, model="tiny", **parallel):
    cfg = build_config(overrides={"model.name": model, "train.seq_len": 64, "train.global_batch": 8})
    layout = Layout(**parallel).with_(dp=world // (parallel.get("tp", 1) * parallel.get("pp", 1)))
    hw = profile_hardware(read_profile(path), world)
    return step_time(cfg.model, layout, Cluster(hw, world, world), 64, 8, "float32")


def _variant(tmp_path, doc, name, change):
    changed = copy.deepcopy(doc)
    change(changed["fitted"])
    return write_profile(tmp_path / name, {k: v for k, v in changed.items() if k not in ("format", "version")})


def test_profile_written_read_back_and_priced(profile, tmp_path):
    path, doc = profile
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == "fived-machine-profile" and on_disk["nproc"] == 2
    assert {"hostname", "cpu_count", "device", "memory_gib"} <= set(on_disk["machine"]) and on_disk["torch"]
    assert set(on_disk["fitted"]["collectives"]) == {
        "all_reduce",
        "all_gather_single",
        "reduce_scatter_single",
        "all_to_all_single",
        "send",
    }
    assert all(s > 0 for op in on_disk["measured"]["collectives"] for s in op[3:])
    base = _step(path, pp=2)  # (pipeline sends are never hidden: their time is the profile's, as it is)
    assert base.pp > 0 and base.compute > 0

    def slow_links(fitted):  # every collective 10x slower
        for by_size in fitted["collectives"].values():
            for curve in by_size.values():
                curve["seconds"] = [s * 10 for s in curve["seconds"]]
                curve["bytes_per_s"] /= 10

    def slow_gemms(fitted):  # every GEMM rate halved
        fitted["gemm"]["values"] = [[[v / 2 for v in row] for row in plane] for plane in fitted["gemm"]["values"]]

    slow = _step(_variant(tmp_path, doc, "links.json", slow_links), pp=2)
    assert slow.pp == pytest.approx(10 * base.pp) and slow.compute == base.compute
    gemm = _step(_variant(tmp_path, doc, "gemm.json", slow_gemms), pp=2)
    assert gemm.compute > base.compute  # (the exposed reduction may shrink: more compute to hide under)

    def slow_experts(fitted):  # the experts' loop 10x slower on the host
        fitted["expert_overhead_s"] *= 10

    moe = _step(path, model="tiny-moe", zero=0)
    assert _step(_variant(tmp_path, doc, "experts.json", slow_experts), model="tiny-moe", zero=0).compute > moe.compute


def test_bad_profile_is_one_line_naming_file_and_field(profile, tmp_path, capsys):
    path, doc = profile
    broken = copy.deepcopy(json.loads(path.read_text()))
    broken["fitted"]["collectives"]["all_reduce"]["2"]["seconds"][0] = -1.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(broken))
    flags = ["plan", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch-tokens", "512"]
    assert main([*flags, "--machine", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "fitted.collectives.all_reduce.2.seconds[0]=-1.0" in err[0], err
    broken["fitted"]["collectives"]["all_reduce"]["2"]["seconds"][0] = 1e-4
    del broken["fitted"]["launch_s"]
    bad.write_text(json.dumps(broken))
    assert main([*flags, "--machine", str(bad)]) == 2
    assert "fitted.launch_s" in capsys.readouterr().err
    assert main([*flags, "--machine", str(path)]) == 0
    assert f"machine profile {path}" in capsys.readouterr().out


def test_calibrate_never_writes_over_a_users_file_or_a_symlink(tmp_path, capsys):
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    assert main(["calibrate", "--output", str(mine), "--nproc", "2", "--quick"]) == 2
    assert "exists and fived did not write it" in capsys.readouterr().err and mine.read_text() == '{"mine": true}'
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    assert main(["calibrate", "--output", str(link), "--nproc", "2", "--quick"]) == 2
    assert "symbolic link" in capsys.readouterr().err and not (tmp_path / "elsewhere.json").exists()


def _one_gpu(doc: dict, **fitted) -> dict:
    """`doc` as one H200's calibration would write it: one rank, no collectives measured."""
    gpu = copy.deepcopy(doc)
    gpu["machine"].update(device_type="cuda", device="NVIDIA H200", memory_gib=139.8)
    gpu["nproc"] = 1
    gpu["fitted"].update(collectives={}, rank_slowdown=1.0, **fitted)
    return gpu


def test_one_gpus_profile_prices_its_compute_and_the_catalogues_links(profile, tmp_path):
    """One GPU measures no collective: a plan of 8 prices its links as the catalogue's H200 does, and
    the compute from the profile."""
    _, doc = profile
    path = write_profile(
        tmp_path / "h200.json", {k: v for k, v in _one_gpu(doc).items() if k not in ("format", "version")}
    )
    read = read_profile(path)
    assert read.collectives == {} and read.on_gpu and read.nproc == 1
    hw = profile_hardware(read, 8)
    assert hw.nvlink_gbps == hardware("h200").nvlink_gbps and hw.memory_gib == 139.8
    c = CALIBRATION.constants
    for op in ("all_reduce", "reduce_scatter_single", "all_to_all_single", "send"):
        for cluster in (Cluster(hw, 8, 8), Cluster(hw, 16, 8)):  # (inside a node, across two)
            link = group_link(cluster, 1, cluster.gpus, c)
            got = collective_seconds(op, 2**24, link, hw, c)
            assert got == collective_seconds(op, 2**24, link, hardware("h200"), c) and got > 0
    cfg = build_config(overrides={"model.name": "tiny", "train.seq_len": 64, "train.global_batch": 8})
    mine = step_time(cfg.model, Layout(), Cluster(hw, 1, 8), 64, 8, "bfloat16")
    catalogue = step_time(cfg.model, Layout(), Cluster(hardware("h200"), 1, 8), 64, 8, "bfloat16")
    assert mine.compute != pytest.approx(catalogue.compute)  # (the profile's measured rates)


def test_a_gpus_host_dispatch_costs_only_what_outlasts_the_devices_work(profile, tmp_path):
    """Kernels launch asynchronously: on a GPU's profile the step pays the host's time beyond the
    device's; on CPU ranks (synchronous) all of it."""
    _, doc = profile
    cfg = build_config(overrides={"model.name": "tiny", "train.seq_len": 64, "train.global_batch": 8})

    def priced(name: str, changed: dict):
        path = write_profile(tmp_path / name, {k: v for k, v in changed.items() if k not in ("format", "version")})
        return step_time(cfg.model, Layout(), Cluster(profile_hardware(read_profile(path), 1), 1, 1), 64, 8, "float32")

    cpu = copy.deepcopy(doc)
    cpu["fitted"].update(layer_overhead_s=1e-3, step_overhead_s=1e-3)
    on_cpu = priced("cpu.json", cpu)
    assert on_cpu.overhead == pytest.approx(on_cpu.layer_host + 1e-3) and on_cpu.overhead > 0
    hidden = priced("gpu.json", _one_gpu(doc, layer_overhead_s=1e-9, step_overhead_s=1e-9))
    assert hidden.overhead == 0.0 and hidden.layer_host == 0.0
    host_bound = priced("slow.json", _one_gpu(doc, layer_overhead_s=1.0, step_overhead_s=1.0))
    device = host_bound.compute + host_bound.tp + host_bound.cp + host_bound.ep + host_bound.pp
    cpu["fitted"].update(layer_overhead_s=1.0, step_overhead_s=1.0)
    host = priced("cpu-slow.json", cpu).overhead  # (the same host times, paid whole on CPU)
    assert host_bound.overhead == pytest.approx(host - device) and 0 < host_bound.overhead < host


def test_ranks_one_per_gpu_two_at_least_on_cpu(monkeypatch):
    from fived.tools.calibrate import check_ranks

    cpu = torch.device("cpu")
    assert check_ranks(None, cpu) == 4 and check_ranks(3, cpu) == 3
    with pytest.raises(ConfigError, match="collectives need 2 ranks at least"):
        check_ranks(1, cpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # (a count, not torch.distributed)
    gpu = torch.device("cuda")
    assert check_ranks(None, gpu) == 1 and check_ranks(1, gpu) == 1
    with pytest.raises(ConfigError, match="one rank per GPU: this machine has 1"):
        check_ranks(2, gpu)


def test_queued_timing_divides_by_the_calls_it_made():
    """A GPU's kernels are timed queued, in batches with one synchronisation each: the figure is
    seconds per call (here a 2 ms sleep, timed on the CPU's no-op synchronisation)."""
    from fived.tools.calibrate import queued_seconds

    calls = []

    def sleep():
        calls.append(time.perf_counter())
        time.sleep(0.002)

    seconds = queued_seconds(sleep, 0.05, torch.device("cpu"))
    assert 0.002 <= seconds < 0.004 and len(calls) >= 2 * 5
