"""`fived calibrate` writes a machine profile; the planner reads it back and prices with its numbers."""

import copy
import json
import re

import pytest
import torch

from fived.api import cluster_of
from fived.cli.main import main
from fived.config import ConfigError, build_config
from fived.layout.flops import attention_flops_per_token
from fived.layout.layout import Layout
from fived.planner.basis import basis
from fived.planner.constants import CALIBRATION
from fived.planner.hardware import hardware
from fived.planner.links import collective_seconds, group_link
from fived.planner.profile import RANKS_KEYS, profile_hardware, read_profile, write_profile
from fived.planner.runtimes import FIVED, PLANNED_RUNTIMES
from fived.planner.timing import Cluster, attention_seconds, step_time
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

    def links_alone(fitted):  # (what fived's trainer measured each dimension adding does not scale with them)
        fitted.pop("dimension_s")

    base = _step(_variant(tmp_path, doc, "base.json", links_alone), pp=2)  # (pipeline sends are never hidden)
    assert base.pp > 0 and base.compute > 0

    def slow_links(fitted):  # every collective 10x slower
        links_alone(fitted)
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


def test_a_cpu_profiles_plan_prices_and_runs_what_it_measured(profile, capsys):
    """CPU ranks measured float32 GEMMs: the plan prices float32 and its command trains in it (it
    priced bf16 with float32's rates and printed `--train.dtype bfloat16`). And uncompiled blocks, as
    `fived train` runs on CPU by default (it priced compiled ones and its command compiled them: tens of
    seconds of inductor on CPU); a GPU's plan compiles them."""
    path, _ = profile
    flags = ["plan", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch-tokens", "512"]
    assert main([*flags, "--machine", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"
    assert main([*flags, "--machine", str(path)]) == 0
    out = capsys.readouterr().out
    run = next(line for line in out.splitlines() if "run it:" in line)
    assert "--train.dtype float32" in run and "--train.compile" not in run, run
    assert out.splitlines()[0].endswith("runtime fived, blocks uncompiled"), out
    assert main([*flags, "--gpu", "h100"]) == 0
    assert "--train.compile true" in next(line for line in capsys.readouterr().out.splitlines() if "run it:" in line)
    assert main([*flags, "--gpu", "h100", "--json"]) == 0  # (a GPU's catalogue entry: bf16 mixed precision)
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    # measured on 2 ranks, priced for 4: the basis says so (and not where it prices what it measured)
    wider = ["--gpus", "4", "--global-batch-tokens", "1024"]
    assert main([*flags[:3], *wider, "--seq", "64", "--machine", str(path), "--json"]) == 0
    assert any(line.startswith("extrapolated: collectives") for line in json.loads(capsys.readouterr().out)["basis"])
    assert main([*flags, "--machine", str(path), "--json"]) == 0
    assert not any("extrapolated: collectives" in line for line in json.loads(capsys.readouterr().out)["basis"])


def test_calibrate_never_writes_over_a_users_file_or_a_symlink(tmp_path, capsys):
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    assert main(["calibrate", "--output", str(mine), "--nproc", "2", "--quick"]) == 2
    assert "exists and fived did not write it" in capsys.readouterr().err and mine.read_text() == '{"mine": true}'
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    assert main(["calibrate", "--output", str(link), "--nproc", "2", "--quick"]) == 2
    assert "symbolic link" in capsys.readouterr().err and not (tmp_path / "elsewhere.json").exists()


def _one_gpu(doc: dict, device: str = "NVIDIA H200", **fitted) -> dict:
    """`doc` as one GPU's calibration would write it: one rank, no collectives nor what ranks add, kernels
    timed queued."""
    gpu = copy.deepcopy(doc)
    gpu["machine"].update(device_type="cuda", device=device, memory_gib=139.8)
    gpu.update(nproc=1, timing="queued")
    gpu["fitted"].update(collectives={}, rank_slowdown=1.0, dimension_s={}, **fitted)
    return gpu


def _written(tmp_path, name: str, doc: dict):
    return write_profile(tmp_path / name, {k: v for k, v in doc.items() if k not in ("format", "version")})


def test_one_gpus_profile_prices_its_compute_and_the_catalogues_links(profile, tmp_path):
    """One GPU measures no collective: a plan of 8 or 16 prices its links as the catalogue's H200 does
    (across nodes too: --gpus-per-node holds), its attention at the measured rate of the whole score
    matrix (nothing halved: the rate counts the blocks a causal kernel skips), MFU against the GPU's
    rated peak, and its basis says what is measured."""
    _, doc = profile
    rate = 1e14
    gpu = _one_gpu(doc)
    gpu["fitted"]["attention"]["values"] = [[rate for _ in row] for row in gpu["fitted"]["attention"]["values"]]
    path = _written(tmp_path, "h200.json", gpu)
    read = read_profile(path)
    assert read.collectives == {} and read.on_gpu and read.nproc == 1
    hw = profile_hardware(read, 8)
    assert hw.nvlink_gbps == hardware("h200").nvlink_gbps and hw.memory_gib == 139.8
    assert hw.peak_tflops == hardware("h200").peak_tflops
    c = CALIBRATION.constants
    for op in ("all_reduce", "reduce_scatter_single", "all_to_all_single", "send"):
        for cluster in (Cluster(hw, 8, 8), Cluster(hw, 16, 8)):  # (inside a node, across two)
            link = group_link(cluster, 1, cluster.gpus, c)
            got = collective_seconds(op, 2**24, link, hw, c)
            assert got == collective_seconds(op, 2**24, link, hardware("h200"), c) and got > 0
    assert cluster_of("tiny", 16, 8, "h100", 64, 1024, machine=str(path))[1].gpus_per_node == 8
    cfg = build_config(overrides={"model.name": "tiny", "train.seq_len": 64, "train.global_batch": 8})
    for runtime in (FIVED, PLANNED_RUNTIMES["fived"]):
        got = attention_seconds(
            cfg.model, Layout(), Cluster(profile_hardware(read, 1), 1, 1), 64, 8, "bfloat16", runtime
        )
        assert got == pytest.approx(8 * 64 * attention_flops_per_token(cfg.model, 64) / rate, rel=1e-12), runtime
    lines = basis(cfg.model, Cluster(hw, 16, 8), FIVED, Layout().with_(dp=16), 64)
    assert lines[0].startswith(f"measured: machine profile {path}") and "links are the catalogue's" in lines[1]
    assert not any("published runs" in line for line in lines), lines


def test_a_gpu_the_catalogue_lacks_plans_one_gpu_only(profile, tmp_path):
    _, doc = profile
    read = read_profile(_written(tmp_path, "l40s.json", _one_gpu(doc, device="NVIDIA L40S")))
    assert profile_hardware(read, 1).memory_gib == 139.8
    with pytest.raises(ConfigError, match=r"catalogue lacks this GPU \(NVIDIA L40S\) and one GPU measured no link"):
        profile_hardware(read, 2)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.pop("timing"), "timing=None"),  # (a GPU profile that timed launches: before 2026-11-29)
        (lambda d: d.update(nproc=1.5), "nproc=1.5"),
        (lambda d: d["machine"].update(device_type="cpu"), "nproc=1.0"),  # (a CPU profile measures 2 ranks)
        (lambda d: d["fitted"].update(collectives={"send": {}}), "fitted.collectives=send"),
    ],
)
def test_a_gpu_profile_that_cannot_be_right_is_one_line(profile, tmp_path, change, field):
    _, doc = profile
    bad = _one_gpu(doc)
    change(bad)
    path = _written(tmp_path, "bad.json", bad)
    with pytest.raises(ConfigError, match=re.escape(field)):
        read_profile(path)


def test_a_gpus_host_dispatch_costs_only_what_outlasts_the_devices_work(profile, tmp_path):
    """Kernels launch asynchronously: on a GPU's profile the step pays the host's time beyond the
    device's; on CPU ranks (synchronous) all of it; on a GPU too for a MoE model (fived reads its
    experts' token counts on the host in every MoE layer: the host cannot run ahead)."""
    _, doc = profile

    def priced(name: str, changed: dict, model: str = "tiny"):
        cfg = build_config(overrides={"model.name": model, "train.seq_len": 64, "train.global_batch": 8})
        hw = profile_hardware(read_profile(_written(tmp_path, name, changed)), 1)
        return step_time(cfg.model, Layout(zero=0), Cluster(hw, 1, 1), 64, 8, "float32")

    cpu = copy.deepcopy(doc)
    cpu["fitted"].update(layer_overhead_s=1e-3, step_overhead_s=1e-3, dimension_s={})  # (the host's figures alone)
    on_cpu = priced("cpu.json", cpu)
    assert on_cpu.overhead == pytest.approx(on_cpu.layer_host + 1e-3) and on_cpu.overhead > 0
    hidden = priced("gpu.json", _one_gpu(doc, layer_overhead_s=1e-9, step_overhead_s=1e-9))
    assert hidden.overhead == 0.0 and hidden.layer_host == 0.0
    host_bound = priced("slow.json", _one_gpu(doc, layer_overhead_s=1.0, step_overhead_s=1.0))
    device = host_bound.compute + host_bound.tp + host_bound.cp + host_bound.ep + host_bound.pp
    cpu["fitted"].update(layer_overhead_s=1.0, step_overhead_s=1.0)
    host = priced("cpu-slow.json", cpu).overhead  # (the same host times, paid whole on CPU)
    assert host_bound.overhead == pytest.approx(host - device) and 0 < host_bound.overhead < host
    moe_cpu = priced("moe-cpu.json", cpu, "tiny-moe")
    moe_gpu = priced("moe-gpu.json", _one_gpu(doc, layer_overhead_s=1.0, step_overhead_s=1.0), "tiny-moe")
    assert moe_gpu.overhead == pytest.approx(moe_cpu.overhead) and moe_gpu.overhead > 0


def test_ranks_two_at_least_on_cpu_one_on_a_gpu(monkeypatch):
    from fived.tools.calibrate import check_ranks

    cpu = torch.device("cpu")
    assert check_ranks(None, cpu) == 4 and check_ranks(3, cpu) == 3
    for nproc in (1, 0):
        with pytest.raises(ConfigError, match="collectives need 2 ranks at least"):
            check_ranks(nproc, cpu)
    gpu = torch.device("cuda")
    assert check_ranks(None, gpu) == 1 and check_ranks(1, gpu) == 1
    with pytest.raises(ConfigError, match="no collectives yet"):
        check_ranks(2, gpu)


def test_queued_timing_divides_by_the_calls_it_made():
    """A GPU's kernels are timed queued, in batches with one synchronisation each: the figure is the
    time spent over the calls made (a sleep that records its calls, on the CPU's no-op synchronisation)."""
    from fived.tools import calibrate as cal

    calls: list[float] = []
    clock = iter(range(10**6))
    real = cal.time.perf_counter
    cal.time.perf_counter = lambda: float(next(clock))  # (each reading one "second" after the last)
    try:
        seconds = cal.queued_seconds(lambda: calls.append(1), 30.0, torch.device("cpu"))
    finally:
        cal.time.perf_counter = real
    # the probe (1 s) sets batches of int(0.2 * 30 / 1) = 6 calls, each batch timed as 1 s, until 30 s are spent
    assert len(calls) == 1 + 30 * 6 and seconds == pytest.approx(1 / 6)


def test_compute_is_measured_on_operands_that_rotate_through_more_memory_than_a_cache(monkeypatch):
    """A training step's GEMMs and element-wise ops read tensors written long before and write where no
    recent op did: calibrate's sets of operands span ROTATION_BYTES, are handed out in turn, and every
    timed call of the GEMMs', attention's and element-wise measurements (their dispatch bases too)
    takes the next set (one set reused stays in cache: docs/planner.md has the figures)."""
    from fived.tools import calibrate as cal

    made: list[torch.Tensor] = []
    take = cal.rotation(lambda: made.append(torch.empty(0)) or (made[-1],), 2**20, torch.device("cpu"))
    assert len(made) == cal.ROTATION_BYTES["cpu"] // 2**20  # (64 sets of 1 MiB)
    order = [id(take()[0]) for _ in range(2 * len(made))]
    assert order[: len(made)] == [id(t) for t in made] and order[len(made) :] == order[: len(made)]
    small: list[int] = []
    cal.rotation(lambda: small.append(1) or (), 1, torch.device("cpu"))
    assert len(small) == cal.MAX_SETS  # (a shape of a few bytes: its dispatch is its time)

    draws: list[list[int]] = []  # per rotation made, the id of the set each call took
    sets: list[tuple] = []  # the sets the timed calls took
    real = cal.rotation

    def counted(make, nbytes, device):
        take, mine = real(make, nbytes, device), []
        draws.append(mine)
        return lambda: mine.append(id(got := take())) or sets.append(got) or got

    def three_calls(fn, budget_s, device):  # (each measurement's timed calls, without timing them)
        for _ in range(3):
            fn()
        return 1.0

    monkeypatch.setattr(cal, "rotation", counted)
    monkeypatch.setattr(cal, "timed", three_calls)
    cpu = torch.device("cpu")
    cal.linear_seconds(16, 8, 32, 0.0, cpu)
    cal.attention_seconds(16, 8, 2, 0.0, cpu)
    cal.measure_stream(cal.QUICK, 0.0, cpu)
    assert len(draws) == 2 + 1 + len(cal.QUICK.stream_bytes)  # (the stream's dispatch base rotates too)
    assert all(len(d) == 3 and d[0] != d[1] != d[2] != d[0] for d in draws), draws
    # the GEMMs' and attention's operands hold random values, as a step's do (a GPU's tensor cores run
    # faster on constant ones: docs/gpu.md)
    for fn in (lambda: cal.linear_seconds(16, 8, 32, 0.0, cpu), lambda: cal.attention_seconds(16, 8, 2, 0.0, cpu)):
        sets.clear()
        fn()
        assert sets and all(t.float().std() > 0.5 for got in sets for t in got), [t.flatten()[:4] for t in sets[0]]


def test_what_fiveds_layers_add_per_dimension_is_measured_and_priced(profile, tmp_path):
    """calibrate times fived's trainer at negligible shapes on its ranks, tp, cp and ep at 2 against data
    parallelism, with 1 and 3 layers, and pp 2 with 2 and 4 micro-batches; what each dimension adds beyond
    what the planner prices for it is in the profile, and the planner adds exactly that to the dimension's
    time (per layer and micro-batch, pp per micro-batch, at the ranks' share of a core; ep on MoE layers
    only), nothing to a layout without it."""
    path, doc = profile
    on_disk = json.loads(path.read_text())
    assert set(on_disk["fitted"]["dimension_s"]) == {"tp", "cp", "ep", "pp", *RANKS_KEYS}
    assert all(v >= 0 for v in on_disk["fitted"]["dimension_s"].values())
    runs = on_disk["measured"]["dimensions"]["step_s"]
    assert set(runs) == {"tp", "cp", "ep", "dense base", "moe base", "pp"} and all(
        s > 0 for v in runs.values() for s in v
    )

    def extra(fitted):
        fitted["dimension_s"] = {"tp": 1e-3, "cp": 2e-3, "ep": 4e-3, "pp": 8e-3}

    def none(fitted):
        fitted["dimension_s"] = {}

    with_, without = _variant(tmp_path, doc, "dims.json", extra), _variant(tmp_path, doc, "none.json", none)
    share = profile_hardware(read_profile(with_), 4).core_share

    def step(path, model, **parallel):
        cfg = build_config(overrides={"model.name": model, "train.seq_len": 64, "train.global_batch": 8})
        hw = profile_hardware(read_profile(path), 4)
        return cfg.model, step_time(cfg.model, Layout(**parallel), Cluster(hw, 4, 4), 64, 8, "float32")

    for model, parallel, part, seconds in (
        ("tiny", dict(dp=2, tp=2), "tp", 1e-3),
        ("tiny", dict(dp=2, cp=2), "cp", 2e-3),
        ("tiny-moe", dict(dp=4, ep=2), "ep", 4e-3),
    ):
        m, got = step(with_, model, **parallel)
        _, base = step(without, model, **parallel)
        layers = m.n_layers - m.n_dense_layers if part == "ep" else m.n_layers
        micro = 8 // parallel["dp"]
        assert getattr(got, part) - getattr(base, part) == pytest.approx(seconds * layers * micro / share)
        assert got.total - base.total == pytest.approx(getattr(got, part) - getattr(base, part))
    m, got = step(with_, "tiny", dp=2, pp=2)  # pp: per micro-batch (its bubble grows with the rank's work)
    _, base = step(without, "tiny", dp=2, pp=2)
    assert got.pp - base.pp == pytest.approx(8e-3 * 4 / share) and got.bubble >= base.bubble
    for model in ("tiny", "tiny-moe"):  # (data parallelism alone: nothing added)
        assert step(with_, model, dp=4)[1].total == step(without, model, dp=4)[1].total


def test_what_the_calibrations_ranks_add_is_priced_for_every_layout(profile, tmp_path):
    """The ranks' own figures (the data-parallel bases' steps beyond their price) go to every layout on
    those ranks, as host overhead: per step, and per layer and micro-batch of the busiest rank (its
    stage's layers under a pipeline), a MoE model's figures besides on its MoE layers."""
    path, doc = profile
    figures = {"ranks_layer": 1e-3, "ranks_step": 2e-3, "moe_layer": 4e-3, "moe_step": 8e-3}

    def ranks(fitted):
        fitted["dimension_s"] = dict(figures)

    def none(fitted):
        fitted["dimension_s"] = {}

    with_, without = _variant(tmp_path, doc, "ranks.json", ranks), _variant(tmp_path, doc, "none2.json", none)
    share = profile_hardware(read_profile(with_), 4).core_share
    for model, parallel, micro in (
        ("tiny", dict(dp=4), 1),
        ("tiny", dict(dp=2, tp=2), 1),
        ("tiny", dict(dp=2, pp=2), 4),
        ("tiny-moe", dict(dp=4), 1),
        ("tiny-moe", dict(dp=2, pp=2), 4),
    ):
        cfg = build_config(
            overrides={"model.name": model, "train.seq_len": 64, "train.global_batch": 8, "train.microbatches": micro}
        )
        m, layout = cfg.model, Layout.from_config(cfg, 4)
        got, base = (
            step_time(m, layout, Cluster(profile_hardware(read_profile(p), 4), 4, 4), 64, 8, "float32")
            for p in (with_, without)
        )
        passes = m.n_layers // parallel.get("pp", 1) * micro
        added = figures["ranks_step"] + figures["ranks_layer"] * passes
        if m.is_moe:
            added += figures["moe_step"] + figures["moe_layer"] * passes * (m.n_layers - m.n_dense_layers) / m.n_layers
        assert got.overhead - base.overhead == pytest.approx(added / share), (model, parallel)
        assert got.total - base.total == pytest.approx(added / share), (model, parallel)
    # one rank alone meets no other (its host time is the profile's own, measured on one rank)
    cfg = build_config(overrides={"model.name": "tiny-moe", "train.seq_len": 64, "train.global_batch": 8})
    alone = [
        step_time(cfg.model, Layout(), Cluster(profile_hardware(read_profile(p), 1), 1, 1), 64, 8, "float32").total
        for p in (with_, without)
    ]
    assert alone[0] == alone[1]


def test_a_clamped_figure_leaves_the_other_fitted_alone():
    """A base measured with a negative slope beyond its price: its per-layer figure is 0 and its per-step
    figure the mean of what both runs measured beyond the price (not the intercept of the line the
    clamp discarded); a negative intercept: the slope through the origin."""
    from fived.tools.calibrate_ranks import line_at_or_above_zero

    assert line_at_or_above_zero((1, 3), [2.0, 4.0]) == (1.0, 1.0)
    assert line_at_or_above_zero((1, 3), [5.0, 3.0]) == (0.0, 4.0)  # (the line said -1/layer, 6 a step)
    assert line_at_or_above_zero((1, 3), [1.0, 5.0]) == pytest.approx((1.6, 0.0))  # (16 / 10 through 0)
    assert line_at_or_above_zero((1, 3), [-1.0, -3.0]) == (0.0, 0.0)


@pytest.mark.parametrize(
    "value, field",
    [({"tp": -1.0}, "fitted.dimension_s.tp=-1.0"), ({"dp": 1.0}, "fitted.dimension_s={'dp': 1.0}")],
)
def test_a_bad_dimension_figure_is_one_line(profile, tmp_path, capsys, value, field):
    path, doc = profile

    def bad(fitted):
        fitted["dimension_s"] = value

    broken = _variant(tmp_path, doc, "bad.json", bad)
    flags = ["plan", "--model", "tiny", "--gpus", "2", "--seq", "64", "--global-batch-tokens", "512"]
    assert main([*flags, "--machine", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err


def test_the_dimension_figures_price_back_what_was_measured(profile):
    """`unpriced_dimensions`' figures, written into the profile, make the planner price the calibration's
    own runs (at its ranks) as they were measured: the data-parallel bases' steps, and between the runs
    exactly the slopes that were measured: the sign, the bases and the core share of the fit (a figure
    clamped at 0 aside: these are far above what is priced)."""
    from fived.planner.profile import profile_of
    from fived.tools import calibrate_ranks as ranks
    from fived.tools.calibrate_ranks import unpriced_dimensions

    path, _ = profile
    doc = json.loads(path.read_text())
    doc["fitted"].pop("dimension_s")
    doc["fitted"]["rank_slowdown"] = 2.0  # (ranks sharing cores: the fit's core share matters)
    added = {"tp": 0.05, "cp": 0.06, "ep": 0.07, "pp": 0.08}
    bases = {"dense base": [0.3, 0.34], "moe base": [0.6, 0.7]}  # (far above their price: no figure clamped)
    doc["fitted"]["dimension_s"] = unpriced_dimensions(doc, str(path), {"step_s": bases, "added_s": added})
    fitted = profile_of(doc, str(path))
    n = fitted.nproc
    cluster = Cluster(profile_hardware(fitted, n), n, n)

    def priced(parallel, experts, layers, micro):
        cfg = ranks.host_config(layers, experts, parallel, micro)
        t = cfg.train
        return step_time(cfg.model, Layout.from_config(cfg, n), cluster, t.seq_len, t.global_batch, t.dtype).total

    layouts = {name: (parallel, experts) for name, parallel, experts in ranks.dimension_layouts(n)}

    def slope(run):
        return ranks.per_layer([priced(*layouts[run], layers, 1) for layers in ranks.DIMENSION_LAYERS])

    for run, steps in bases.items():  # the bases' steps themselves, at both layer counts
        got = [priced(*layouts[run], layers, 1) for layers in ranks.DIMENSION_LAYERS]
        assert got == pytest.approx(steps, rel=1e-9), run
    for dim, base in ranks.DIMENSION_BASES.items():
        assert slope(dim) - slope(base) == pytest.approx(added[dim], rel=1e-9), dim
    pipeline = [priced(ranks.pipeline_layout(n), 0, ranks.PIPELINE_LAYERS, m) for m in ranks.PIPELINE_MICROBATCHES]
    assert ranks.per_microbatch(pipeline) == pytest.approx(added["pp"], rel=1e-9)


def test_on_cpu_ranks_no_collective_hides_under_compute(profile):
    """gloo's collectives are the work of the CPU the ranks compute on (copies, sums, the socket loop):
    under a CPU profile an overlapped collective is priced whole (bench_planner_cpu measured ZeRO-0's
    overlapped reduction exposed: docs/planner.md); the same figures on a device hide part of it."""
    from dataclasses import replace

    path, _ = profile
    cpu = profile_hardware(read_profile(path), 4)
    device = replace(cpu, profile=replace(cpu.profile, machine={**cpu.profile.machine, "device_type": "cuda"}))
    cases = [  # (model, the part, an overlapped layout, its sequential twin (its runtime))
        ("tiny", "tp", Layout(dp=2, tp=2, tp_overlap=True), None),
        ("tiny", "dp", Layout(dp=4), (Layout(dp=4), replace(FIVED, grad_overlap=False))),
        ("tiny", "dp", Layout(dp=4, zero=2, overlap_grad_reduce=True), (Layout(dp=4, zero=2), FIVED)),
        ("tiny", "cp", Layout(dp=2, cp=2), None),
        ("tiny-moe", "ep", Layout(dp=2, ep=2, ep_overlap=True), None),
    ]
    for name, part, overlapped, twin in cases:
        cfg = build_config(overrides={"model.name": name, "train.seq_len": 64, "train.global_batch": 8})
        priced = {
            kind: getattr(step_time(cfg.model, overlapped, Cluster(hw, 4, 4), 64, 8, "float32"), part)
            for kind, hw in (("cpu", cpu), ("device", device))
        }
        assert 0 <= priced["device"] < priced["cpu"], (name, part, priced)  # (the ring may hide whole)
        if twin is not None:  # (tp's and ep's overlaps run other collectives (chunks), the ring has no twin)
            layout, runtime = twin
            whole = getattr(step_time(cfg.model, layout, Cluster(cpu, 4, 4), 64, 8, "float32", runtime), part)
            assert priced["cpu"] == pytest.approx(whole, rel=1e-12), (name, part)


def test_a_cpu_run_on_a_gpu_host_is_priced_as_its_cpu_ranks(monkeypatch):
    """`local_hardware(world, cuda=...)`: a run's own device decides, and a CPU run asks nothing of CUDA
    (its forked ranks must not); unsaid, what the host has."""
    import torch

    from fived.planner.hardware import local_hardware

    def no_cuda_here(*_):
        raise AssertionError("a CPU run asked CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", no_cuda_here)
    assert local_hardware(4, cuda=False).name == "cpu"
    with pytest.raises(AssertionError, match="asked CUDA"):
        local_hardware(4)
