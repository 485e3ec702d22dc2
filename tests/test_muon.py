"""train.optimizer=muon: the update is Muon's (one device), its plan places every piece of every
matrix (plain Python, many layouts), and on real gloo ranks every layout trains exactly like one
device, orthogonalises each matrix once per step, and moves and keeps the bytes the planner says."""

import dataclasses
import math

import pytest
import torch

from fived.config import build_config
from fived.layout.bounds import ns_coefficients
from fived.layout.layout import Layout
from fived.layout.muon_load import busiest_load, busiest_loads, member_load
from fived.layout.muon_plan import Exchange, StagePlan, ns_flops, stage_plan
from fived.layout.placement import Box
from fived.layout.stages import rank_chunks
from fived.optim.muon import Muon, newton_schulz, update_scale
from fived.testing import EXACT, run_on_ranks, tiny_config
from fived.tools.verification import run_verify
from fived.training.report import expected_comm_bytes, expected_state_bytes
from fived.training.trainer import run_training

KELLER = ns_coefficients("3.4445,-4.7750,2.0315", 5)


def test_newton_schulz_pushes_singular_values_toward_one():
    """On a tall and a wide matrix: the singular vectors are the matrix's (the result is close to the
    polar factor U V^T), the singular values within the quintic's band, whatever their spread."""
    generator = torch.Generator().manual_seed(0)
    for shape in ((96, 32), (32, 96)):
        u, _, v = torch.linalg.svd(torch.randn(*shape, generator=generator, dtype=torch.float64), full_matrices=False)
        spread = torch.logspace(0, -2, min(shape), dtype=torch.float64)  # singular values 1 .. 1e-2
        matrix = u @ torch.diag(spread) @ v
        out = newton_schulz(matrix, KELLER)
        sigma = torch.linalg.svdvals(out)
        assert out.shape == shape and sigma.max() < 1.25 and sigma.min() > 0.6, sigma
        polar = u @ v
        cosine = (out * polar).sum() / (out.norm() * polar.norm())
        assert cosine > 0.97, cosine
    # one triple per iteration, spelled out, is the same iteration
    assert ns_coefficients(";".join(["3.4445,-4.7750,2.0315"] * 5), 5) == KELLER
    assert ns_coefficients("1,2", 5) is None and ns_coefficients("1,2,3;1,2,3", 5) is None


def test_update_scales():
    assert update_scale("rms", 256, 64) == pytest.approx(0.2 * 16)
    assert update_scale("spectral", 256, 64) == pytest.approx(2.0)
    assert update_scale("spectral", 64, 256) == 1.0 and update_scale("none", 3, 5) == 1.0


class _Alone:
    """The exchange of a single device holding every matrix (a Linear's weight) whole: Newton-Schulz
    on each, in `dtype`."""

    def __init__(self, shapes, dtype=torch.float64):
        self.shapes, self.dtype = shapes, dtype  # name -> (fan_out, fan_in); the Newton-Schulz dtype

    def fans(self, name):
        return self.shapes[name]

    def view(self, name, stored, box):
        return stored

    def orthogonalize(self, direction, ns, apply):
        for name, shape in self.shapes.items():
            box = Box((0, 0), shape)
            apply(name, box, ns(direction(name, box)))


def test_one_step_is_the_published_update():
    """Two steps of fived's Muon on one matrix equal the update written out: momentum, Nesterov,
    Newton-Schulz, the rms scale, decoupled weight decay, at train.muon_lr; the other tensor gets
    torch's AdamW at train.lr; both follow the schedule, each from its own lr."""
    from fived.optim.adamw import build_scheduler, lr_multiplier

    t = build_config(
        overrides={
            "train.optimizer": "muon",
            "train.lr": 0.01,
            "train.muon_lr": 0.03,
            "train.weight_decay": 0.1,
            "train.warmup_steps": 2,
        }
    ).train
    generator = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(48, 16, generator=generator, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(16, generator=generator, dtype=torch.float64))
    b_ref = torch.nn.Parameter(b.detach().clone())
    adamw = torch.optim.AdamW([b], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=0.0)
    adamw_ref = torch.optim.AdamW([b_ref], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=0.0)
    optimizer = Muon(
        [("layers.0.attention.wq.weight", w)], adamw, t, _Alone({"layers.0.attention.wq.weight": (48, 16)})
    )
    scheduler, reference = build_scheduler(optimizer, t), build_scheduler(adamw_ref, t)
    expected, momentum = w.detach().clone(), torch.zeros_like(w)
    for step in range(2):
        lr = t.muon_lr * lr_multiplier(step, t)
        assert optimizer.param_groups[-1]["lr"] == pytest.approx(lr)
        grad = torch.randn(48, 16, generator=generator, dtype=torch.float64)
        w.grad, b.grad = grad.clone(), torch.ones(16, dtype=torch.float64)
        b_ref.grad = b.grad.clone()
        optimizer.step()
        adamw_ref.step()
        scheduler.step()
        reference.step()
        momentum = 0.95 * momentum + 0.05 * grad
        direction = 0.95 * momentum + 0.05 * grad
        expected = expected * (1 - lr * 0.1) - lr * 0.2 * math.sqrt(48) * newton_schulz(direction, KELLER)
        assert torch.allclose(w.detach(), expected, rtol=0, atol=1e-14)
    assert torch.equal(b, b_ref) and set(optimizer.state[w]) == {"momentum_buffer"}


@pytest.mark.parametrize("scale, torch_rule", [("rms", "match_rms_adamw"), ("spectral", "original")])
def test_the_update_is_torchs_muon(scale, torch_rule):
    """An independent reference: three steps of fived's Muon on a tall, a wide and a square matrix
    (float32 weights, momentum, Nesterov, weight decay) against torch.optim.Muon, whose Newton-Schulz
    runs in bf16: fived's in bf16 gives the same updates (measured: identical), in float32 within
    bf16's rounding (measured under 1.1%)."""
    shapes = {f"layers.0.m{i}": shape for i, shape in enumerate(((48, 16), (16, 48), (32, 32)))}
    t = build_config(
        overrides={"train.optimizer": "muon", "train.lr": 0.02, "train.weight_decay": 0.1, "train.muon_scale": scale}
    ).train
    for dtype, tolerance in ((torch.bfloat16, 1e-3), (torch.float32, 2e-2)):
        generator = torch.Generator().manual_seed(0)
        ours = {name: torch.nn.Parameter(torch.randn(*shape, generator=generator)) for name, shape in shapes.items()}
        theirs = {name: torch.nn.Parameter(w.detach().clone()) for name, w in ours.items()}
        start = {name: w.detach().clone() for name, w in ours.items()}
        unused = torch.nn.Parameter(torch.zeros(3))
        optimizer = Muon(list(ours.items()), torch.optim.AdamW([unused]), t, _Alone(shapes, dtype))
        reference = torch.optim.Muon(
            list(theirs.values()),
            lr=t.lr,
            weight_decay=t.weight_decay,
            momentum=t.muon_momentum,
            nesterov=t.muon_nesterov,
            adjust_lr_fn=torch_rule,
        )
        for _ in range(3):
            for name, shape in shapes.items():
                grad = torch.randn(*shape, generator=generator)
                ours[name].grad, theirs[name].grad = grad.clone(), grad.clone()
            optimizer.step()
            reference.step()
        for name in shapes:
            mine, want = ours[name].detach() - start[name], theirs[name].detach() - start[name]
            assert (mine - want).norm() <= tolerance * want.norm(), (
                name,
                dtype,
                float((mine - want).norm() / want.norm()),
            )


def _one_device_step(cfg):
    """One step of a one-rank Trainer: [(name, box, direction, update)] of the pieces Muon's exchange
    handled (on one device: every matrix whole, every routed expert's on its own)."""
    from fived.training.trainer import Trainer

    trainer = Trainer(cfg, log=False)
    exchange, seen = trainer.optimizer.exchange, {}
    real = exchange.orthogonalize

    def recorded(direction, ns, apply):
        def direction_seen(name, box):
            seen[(name, box)] = [direction(name, box).clone()]
            return seen[(name, box)][0]

        real(
            direction_seen,
            ns,
            lambda name, box, update: seen[(name, box)].append(update.clone()) or apply(name, box, update),
        )

    exchange.orthogonalize = recorded
    trainer.fit(progress=False)
    return [(name, box, *values) for (name, box), values in seen.items()]


def test_one_device_orthogonalises_each_whole_matrix():
    """On one rank the exchange (the code every layout runs) returns Newton-Schulz of each parameter's
    direction whole, and of each routed expert's matrix on its own: what every layout is held to."""
    cfg = tiny_config("tiny-moe", train__optimizer="muon", train__steps=1)
    seen = run_on_ranks(1, _one_device_step, cfg)[0]
    m = cfg.model
    assert len(seen) == m.n_layers * (4 + 3 * m.n_shared_experts + 3 * m.n_experts)  # each routed expert's alone
    for name, box, direction, update in seen:
        assert box.sizes[-2:] == direction.shape[-2:] and math.prod(box.sizes) == direction.numel(), name
        matrix = direction.reshape(direction.shape[-2:])
        want = newton_schulz(matrix, KELLER).reshape(update.shape)
        assert torch.allclose(update, want, rtol=0, atol=1e-13), name


def _unplanned_matrix(cfg):
    """Build a Trainer whose runtime counts the router among Muon's matrices (the plan does not);
    the error it raises, or None."""
    import fived.parallel.data_parallel as data_parallel
    from fived.training.trainer import Trainer

    planned = data_parallel.is_muon_tensor
    data_parallel.is_muon_tensor = lambda spec: planned(spec) or spec.name.endswith("router.weight")
    try:
        Trainer(cfg, log=False)
    except RuntimeError as e:
        return str(e)
    return None


def test_a_matrix_outside_the_plan_is_refused():
    """The matrices the runtime gives Muon are the plan's: one the plan does not know stops the
    optimizer's construction (it used to go to AdamW without a word)."""
    (message,) = run_on_ranks(1, _unplanned_matrix, tiny_config("tiny-moe", train__optimizer="muon", train__steps=1))
    assert message is not None and "router.weight" in message, message


MUON_BUCKET_MB = 2**14 / 2**20  # train.muon_bucket_mb in the tests' buckets: 16 KiB of float64 per rank

PLANS = {  # (model, world, parallel fields): every way a matrix is cut or repeated
    "dp1": ("tiny-moe", 1, {}),
    "zero0-dp4": ("tiny", 4, dict(dp=4)),
    "zero1-dp4": ("tiny-moe", 4, dict(dp=4, zero=1)),
    "zero2-buckets": ("tiny-moe", 4, dict(dp=4, zero=2, overlap_grad_reduce=True, bucket_mb=3000 / 2**20)),
    "zero3-hsdp": ("tiny-moe", 4, dict(dp=4, zero=3, dp_replicate=2)),
    "tp4-kv-replicated": ("tiny", 4, dict(tp=4)),
    "ep2-zero1-cp2": ("tiny-moe", 8, dict(dp=2, cp=2, ep=4, zero=1, tp=2)),
    "ep2-zero3": ("tiny-moe", 4, dict(dp=4, ep=2, zero=3)),
    "pp2-zero0-flat": ("tiny", 4, dict(dp=2, pp=2)),
    "5d": ("tiny-moe", 16, dict(pp=2, dp=2, cp=2, tp=2, ep=4, zero=1)),
    # Muon's own buckets (of MUON_BUCKET_MB per rank: a few matrices each), whole units and experts
    "zero1-muon-buckets": ("tiny-moe", 4, dict(dp=4, zero=1, muon_bucket_mb=MUON_BUCKET_MB)),
    "ep2-zero3-muon-buckets": ("tiny-moe", 4, dict(dp=4, ep=2, zero=3, muon_bucket_mb=MUON_BUCKET_MB)),
    "zero0-tp2-muon-buckets": ("tiny", 4, dict(dp=2, tp=2, muon_bucket_mb=MUON_BUCKET_MB)),
}


def _plan(model, world, fields, pp_rank=0):
    fields = dict(fields)
    train = {"train.microbatches": 2 if fields.get("pp", 1) > 1 else 1}
    if "muon_bucket_mb" in fields:
        train["train.muon_bucket_mb"] = fields.pop("muon_bucket_mb")
    cfg = build_config(overrides={"model.name": model, **{f"parallel.{k}": v for k, v in fields.items()}, **train})
    layout = Layout.from_config(cfg, world)
    return stage_plan(cfg.model, layout, "float64", rank_chunks(cfg.model, layout, pp_rank))


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_places_every_piece_once(name):
    """Every unit's distinct pieces tile it exactly (no gap, no overlap); each member's pieces are
    what it stores; in each bucket the owner ends up with every piece (its own or gathered) and every
    holder gets its pieces back; what one member sends another receives, in the same order; owners
    balanced; the planner's bound of the busiest member holds every member's own figures."""
    plan = _plan(*PLANS[name])
    members = [plan.member_plan(m) for m in range(plan.size)]
    for u, unit in enumerate(plan.units):
        distinct = {box for member in members for box in member.held(u)}
        assert sum(b.numel for b in distinct) == unit.box.numel, unit
        for a in distinct:
            assert all(a == b or a.intersection(b) is None for b in distinct)
    for m, member in enumerate(members):
        assert sum(b.numel for boxes in member.pieces for b in boxes) == plan.stored_elements(m)
    assert [u for first, last in plan.buckets for u in range(first, last)] == list(range(len(plan.units)))
    for bucket, ((first, last), bound) in enumerate(zip(plan.buckets, busiest_loads(plan))):
        for me, member in enumerate(members):
            lists = member.exchanges[bucket]
            for peer in range(plan.size):
                assert lists.gather_send.get(peer, ()) == members[peer].exchanges[bucket].gather_recv.get(me, ())
                assert lists.scatter_send.get(peer, ()) == members[peer].exchanges[bucket].scatter_recv.get(me, ())
            assert all(first <= u < last for items in lists.scatter_recv.values() for u, _ in items)
            for u in range(first, last):
                if plan.units[u].owner == me:
                    gathered = [box for items in lists.gather_recv.values() for v, box in items if v == u]
                    assert sum(b.numel for b in member.held(u) + gathered) == plan.units[u].box.numel
                else:
                    back = [box for items in lists.scatter_recv.values() for v, box in items if v == u]
                    assert back == member.held(u)
            own = member_load(member, bucket)
            assert all(getattr(own, f) <= getattr(bound, f) for f in own.__dataclass_fields__), (own, bound)
            assert own.peak(2, 4) <= bound.peak(2, 4)
        gather, scatter = plan.traffic[bucket]  # (a phase is skipped only when nobody sends in it)
        assert gather == any(m.exchanges[bucket].gather_send for m in members)
        assert scatter == any(m.exchanges[bucket].scatter_send for m in members)
    largest = max(ns_flops(u.rows, u.cols, 1) for u in plan.units)  # (greedy by cost: within one matrix)
    assert max(plan.load) - min(plan.load) <= largest * len(plan.buckets), plan.load


def test_ranks_of_a_replica_send_to_their_own_owner():
    """ZeRO-0 under tp: the owner gathers the other tp halves from its own tp neighbour (the nearest
    holder), so every rank sends the same bytes instead of dp rank 0 sending them all."""
    plan = _plan("tiny", 4, dict(dp=2, tp=2))
    sent = [Exchange.elements(plan.member_plan(m).exchanges[0].gather_send) for m in range(4)]
    assert len(plan.buckets) == 1 and len(set(sent)) == 1 and sent[0] > 0, sent
    for m in range(4):
        peers = list(plan.member_plan(m).exchanges[0].gather_send)
        assert all(p // 2 == m // 2 for p in peers), (m, peers)  # (tp innermost: same dp rank)


def test_a_bucket_is_spread_over_the_ranks():
    """llama3-70b on dp8 x tp8 under ZeRO-1 (each shard owns ten consecutive layers): every bucket
    of Muon's step holds pieces of every shard alike, so no rank stores much more than its share
    of any bucket (buckets in model order would put a whole bucket on one shard's 8 ranks: 8x)."""
    cfg = build_config(
        overrides={
            "model.name": "llama3-70b",
            "parallel.tp": 8,
            "parallel.zero": 1,
            "train.optimizer": "muon",
            "train.dtype": "bfloat16",
        }
    )
    layout = Layout.from_config(cfg, 64)
    plan = stage_plan(cfg.model, layout, "bfloat16", rank_chunks(cfg.model, layout, 0))
    assert len(plan.buckets) > 4
    for (first, last), load in zip(plan.buckets, busiest_loads(plan)):
        share = sum(u.box.numel for u in plan.units[first:last]) / plan.size
        assert load.stored <= 1.5 * share, (first, last, load.stored / share)


def test_a_rank_lays_out_only_its_own_part():
    """Building one member's part of a 64-rank stage of llama3-70b (dp8 x tp8, ZeRO-3: every member
    holds a piece of every matrix) places its own pieces and those of the units it owns, not every
    member's: the placements computed stay a small multiple of the units (every member's would be
    64 times them)."""
    cfg = build_config(overrides={"model.name": "llama3-70b", "parallel.tp": 8, "parallel.zero": 3})
    layout = Layout.from_config(cfg, 64)
    counted = []
    real = StagePlan.placement
    StagePlan.placement = lambda self, name, member: counted.append(member) or real(self, name, member)
    try:
        plan = StagePlan(cfg.model, layout, "bfloat16", rank_chunks(cfg.model, layout, 0))
        plan.member_plan(0), plan.traffic, busiest_load(plan, plan.units)
    finally:
        StagePlan.placement = real
    assert plan.size == 64 and len(counted) < 4 * len(plan.units), (len(counted), len(plan.units))


def test_the_planner_prices_muon_as_configured(monkeypatch):
    """The planner's Muon terms follow the run: Newton-Schulz's time scales with train.muon_ns_steps;
    the exchange's bytes (which leave out each rank's own share) are priced whole, not (n-1)/n of
    them; Muon's matrix elements stream Muon's bytes, more than AdamW's 28 charged for them."""
    from fived.planner import communication
    from fived.planner.constants import CALIBRATION
    from fived.planner.hardware import hardware
    from fived.planner.timing import Cluster, muon_stream_s, orthogonalization_s, step_time

    def layout(**train):
        cfg = build_config(
            overrides={
                "model.name": "llama3-8b",
                "parallel.tp": 2,
                "parallel.zero": 1,
                "train.optimizer": "muon",
                **{f"train.{k}": v for k, v in train.items()},
            }
        )
        return cfg.model, Layout.from_config(cfg, 8)

    (m, five), (_, ten) = layout(), layout(muon_ns_steps=10, muon_ns_coefficients="3.4445,-4.7750,2.0315")
    chunks, hw, c = rank_chunks(m, five, 0), hardware("h100"), CALIBRATION.constants
    assert (five.muon_ns_steps, ten.muon_ns_steps) == (5, 10)
    assert orthogonalization_s(m, ten, "bfloat16", chunks, hw, c) == pytest.approx(
        2 * orthogonalization_s(m, five, "bfloat16", chunks, hw, c)
    )
    cluster = Cluster(hw, 8, 8)
    priced = step_time(m, five, cluster, 4096, 64).optimizer
    real = communication._muon_exchange
    monkeypatch.setattr(
        communication, "_muon_exchange", lambda *args: [dataclasses.replace(c, sent_only=False) for c in real(*args)]
    )
    assert step_time(m, five, cluster, 4096, 64).optimizer < priced  # ((n-1)/n of the bytes: cheaper)
    assert muon_stream_s(m, five, "bfloat16", chunks, hw) > 0


VERIFIED = {  # (model, world, overrides): the layouts, each exact against one device
    "zero0-dp4": ("tiny-moe", 4, dict(parallel__dp=4, parallel__zero=0, train__microbatches=2)),
    "zero1-dp4": ("tiny-moe", 4, dict(parallel__dp=4, parallel__zero=1, train__microbatches=2)),
    "zero2-dp4": ("tiny-moe", 4, dict(parallel__dp=4, parallel__zero=2, train__microbatches=2)),
    "zero3-dp4": ("tiny-moe", 4, dict(parallel__dp=4, parallel__zero=3, train__microbatches=2)),
    "zero1-hsdp": ("tiny", 4, dict(parallel__dp=4, parallel__dp_replicate=2, parallel__zero=1)),
    "zero3-hsdp": ("tiny", 4, dict(parallel__dp=4, parallel__dp_replicate=2, parallel__zero=3)),
    "zero2-buckets": (
        "tiny-moe",
        4,
        dict(
            parallel__dp=4,
            parallel__zero=2,
            parallel__overlap_grad_reduce=True,
            parallel__overlap_param_gather=True,
            parallel__bucket_mb=3000 / 2**20,
        ),
    ),
    "tp2-sp": ("tiny", 2, dict(parallel__tp=2, parallel__sp=True)),
    "tp4-kv-replicated": ("tiny", 4, dict(parallel__tp=4)),
    "ep2-moe": ("tiny-moe", 4, dict(parallel__dp=4, parallel__ep=2, parallel__zero=1)),
    "ep2-zero3": ("tiny-moe", 2, dict(parallel__dp=2, parallel__ep=2, parallel__zero=3)),
    "pp2": ("tiny", 2, dict(parallel__pp=2, train__microbatches=2)),
    "pp2-interleaved-dp2": (
        "tiny-moe",
        4,
        dict(
            parallel__pp=2,
            parallel__dp=2,
            parallel__zero=1,
            train__microbatches=2,
            parallel__pp_schedule="interleaved-1f1b",
            parallel__pp_virtual=2,
        ),
    ),
    # Muon's step in buckets of a few matrices (buckets whose experts need no exchange included)
    "zero1-muon-buckets": ("tiny-moe", 4, dict(parallel__dp=4, parallel__zero=1, train__muon_bucket_mb=MUON_BUCKET_MB)),
    "ep2-zero3-muon-buckets": (
        "tiny-moe",
        4,
        dict(parallel__dp=4, parallel__ep=2, parallel__zero=3, train__muon_bucket_mb=MUON_BUCKET_MB),
    ),
    "dp2-tp2-sp-muon-buckets": (
        "tiny",
        4,
        dict(parallel__dp=2, parallel__tp=2, parallel__sp=True, train__muon_bucket_mb=MUON_BUCKET_MB),
    ),
}


@pytest.mark.parametrize("layout", list(VERIFIED))
def test_layout_matches_one_device(layout):
    model, world, over = VERIFIED[layout]
    report = run_verify(
        tiny_config(model, train__optimizer="muon", train__steps=3, **over), world, printer=lambda *_: None
    )
    assert report.max_relative_difference <= EXACT, report.max_rel


@pytest.mark.parametrize("zero", [1, 3])
def test_the_5d_layout(zero):
    cfg = tiny_config(
        "tiny-moe",
        train__optimizer="muon",
        parallel__pp=2,
        parallel__dp=2,
        parallel__cp=2,
        parallel__tp=2,
        parallel__ep=4,
        parallel__zero=zero,
        train__steps=2,
        train__microbatches=2,
    )
    report = run_verify(cfg, 16, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel


def _stage_group_built(optimizer):
    from fived.parallel.mesh import Mesh

    mesh = Mesh(Layout(dp=2, optimizer=optimizer)).build("cpu", timeout_s=60)
    return "dp_cp_tp" in mesh.flat, sorted(mesh.group_names().values())


def test_the_stage_group_is_built_for_muon_only():
    """The mesh group of Muon's exchange (gloo connects every group eagerly) exists with Muon only."""
    built, names = run_on_ranks(2, _stage_group_built, "adamw")[0]
    assert not built and "dp_cp_tp" not in names, names
    built, names = run_on_ranks(2, _stage_group_built, "muon")[0]
    assert built and "dp_cp_tp" in names


def _counted(cfg):
    """Train one step counting Newton-Schulz calls on this rank; (calls, the stage's units, pp rank)."""
    import fived.optim.muon
    from fived.training.trainer import Trainer

    calls, original = [], fived.optim.muon.newton_schulz
    fived.optim.muon.newton_schulz = lambda m, c: calls.append(tuple(m.shape)) or original(m, c)
    trainer = Trainer(cfg, log=False)
    trainer.fit(progress=False)
    exchange = trainer.optimizer.exchange
    return len(calls), len(exchange.plan.units), exchange.me


def test_each_matrix_is_orthogonalised_once_per_step():
    """pp2 x dp2 x tp2 with experts over ep2: the Newton-Schulz calls of all ranks add up to the
    model's matrices (each routed expert's one), and every rank of a stage does some."""
    cfg = tiny_config(
        "tiny-moe",
        train__optimizer="muon",
        train__steps=1,
        parallel__pp=2,
        parallel__dp=2,
        parallel__tp=2,
        parallel__ep=2,
        train__microbatches=2,
    )
    counted = run_on_ranks(8, _counted, cfg)
    m = cfg.model
    per_layer = 4 + 3 * m.n_shared_experts + 3 * m.n_experts  # attention, shared expert, routed experts
    assert sum(calls for calls, _, _ in counted) == m.n_layers * per_layer
    assert all(calls > 0 for calls, _, _ in counted)
    assert [units for _, units, _ in counted] == [2 * per_layer] * 8  # (each stage: 2 of the 4 layers)


LEDGER = {
    "zero1-dp4": ("tiny-moe", dict(parallel__dp=4, parallel__zero=1)),
    "zero2-buckets": (
        "tiny-moe",
        dict(parallel__dp=4, parallel__zero=2, parallel__overlap_grad_reduce=True, parallel__bucket_mb=3000 / 2**20),
    ),
    "zero3-hsdp": ("tiny", dict(parallel__dp=4, parallel__zero=3, parallel__dp_replicate=2)),
    "zero0-dp2-tp2": ("tiny-moe", dict(parallel__dp=2, parallel__tp=2)),
    "ep2-zero1": ("tiny-moe", dict(parallel__dp=4, parallel__ep=2, parallel__zero=1)),
    "pp2-dp2": ("tiny", dict(parallel__dp=2, parallel__pp=2, train__microbatches=2)),
    "zero0-dp4-bf16": ("tiny", dict(parallel__dp=4, train__dtype="bfloat16")),
    "zero3-ep2-muon-buckets": (
        "tiny-moe",
        dict(parallel__dp=4, parallel__ep=2, parallel__zero=3, train__muon_bucket_mb=MUON_BUCKET_MB),
    ),
}


@pytest.mark.parametrize("layout", list(LEDGER))
def test_exchange_and_state_are_the_formula(layout):
    """On every rank: the exchange's all-to-all bytes and the model-state bytes the ledger measured
    equal the planner's (routed tokens' all-to-all, which follows the routing, left out)."""
    model, over = LEDGER[layout]
    cfg = tiny_config(model, train__optimizer="muon", train__steps=1, train__global_batch=16, **over)
    adamw = expected_state_bytes(tiny_config(model, train__steps=1, train__global_batch=16, **over), 4)
    results = run_on_ranks(4, run_training, cfg, False, False)
    exchanged = 0
    for rank, res in enumerate(results):
        measured = {k: v["bytes"] for k, v in res.comm.items() if not k.startswith("ep/all_to_all")}
        want = {k: v for k, v in expected_comm_bytes(cfg, 4, rank).items() if not k.startswith("ep/all_to_all")}
        assert measured == want, (rank, measured, want)
        assert res.memory == expected_state_bytes(cfg, 4, rank), rank
        exchanged += sum(v for k, v in measured.items() if k.endswith("all_to_all_single"))
    assert exchanged > 0
    assert results[0].memory["optimizer"] < adamw["optimizer"]  # one moment, not two, per Muon element
