"""`fived dryrun --rank R <fived train's flags>`: rank R of any layout, at any world size, built in
this one process, its bytes measured and set beside the planner's.

torch's fake process group stands in for the other ranks: every group of the mesh exists (a
16384-rank mesh builds in a fraction of a second) and every collective returns at once. The rank is
built by `fived.parallel.rank.build_rank`, the function the trainer calls (mesh, pipeline stages,
parallelize on meta, materialise, initialise, data-parallel wrapping, optimizer), so what is
measured is what training allocates. Then one optimizer step runs on zero gradients, as the
trainer's first step would after its backward: Adam's moments (created lazily by the first step)
and the float32 masters' step are real allocations, read by the same ledger call
(`model_state_bytes(dp.tensors())`) the trainer uses for `--report`.

With `--blocks K`, K of the rank's transformer blocks run forward and backward on one micro-batch
of the real sequence length, and the activation ledger's bytes are set beside the planner's. The
fake group moves no data, so the collectives inside blocks are mirrored (every other rank is
assumed to hold and send what this one does) and expert parallelism's token counts are exchanged
as a perfectly balanced route: the planner's assumption.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from fived.config import Config, ConfigError
from fived.launch.memory_fit import available_bytes
from fived.layout.stages import rank_chunks, rank_stages
from fived.model.ledger import ActivationLedger, held_bytes, local_tensor, model_state_bytes
from fived.model.transformer import rope_cos_sin
from fived.parallel.mesh import PRECISIONS, Layout
from fived.parallel.rank import RankModel, build_rank
from fived.planner.memory import activation_bytes_per_microbatch, state_bytes, state_element_bytes
from fived.training.metrics import peak_memory_mb

STATE_KINDS = ("params", "grads", "optimizer")


@contextlib.contextmanager
def fake_process_group(*, rank: int, world: int):
    """The default group of `world` ranks, this process being `rank`; collectives are no-ops."""
    from fived.compat import fake_store

    dist.init_process_group("fake", rank=rank, world_size=world, store=fake_store())
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise ConfigError("--rank", rank, f"must be in 0..{world - 1} (the world has {world} ranks)", "e.g. --rank 0")


def planner_state(cfg: Config, world: int, rank: int) -> dict:
    """The planner's model-state bytes of global rank `rank` and of each of its pipeline chunks."""
    layout = Layout.from_config(cfg, world)
    where = layout.coordinates(rank)
    chunks = rank_chunks(cfg.model, layout, where["pp"])
    total = state_bytes(cfg.model, layout, cfg.train.dtype, chunks, where["shard"], where["edp"])
    stages = [state_bytes(cfg.model, layout, cfg.train.dtype, [c], where["shard"], where["edp"]) for c in chunks]
    _, _, per_owned = state_element_bytes(cfg.train.dtype, layout.zero)
    # float32 masters: 4 of the optimizer's bytes per owned element where the optimizer keeps them
    master = 4 if layout.masters_apart(cfg.train.dtype) else 0
    return {
        **total,
        "masters": total["optimizer"] // per_owned * master,
        "stages": stages,
        "chunks": chunks,
        "where": where,
        "layout": layout,
    }


def check_room(cfg: Config, planner: dict, blocks: int, *, rank: int) -> None:
    """Refuse, before anything is allocated, a rank whose model state (and a quarter more for the
    first step's transients: masters' float32 gradients, reduction pieces; measured 1.06-1.3x) and
    blocks' activations (half more: backward's own) cannot fit in the memory available now."""
    layout = planner["layout"]
    state = sum(planner[k] for k in STATE_KINDS)
    layers = [((lid,), False, False) for chunk in planner["chunks"] for lid in chunk[0]][:blocks]
    acts = sum(activation_bytes_per_microbatch(cfg.model, layout, cfg.train.seq_len, cfg.train.dtype, layers))
    need, have = int(1.25 * state + 1.5 * acts), available_bytes()
    if need > have:
        raise ConfigError(
            "--rank",
            rank,
            f"this rank needs about {need / 2**30:.1f} GiB here (model state "
            f"{state / 2**30:.1f} GiB and the first step's transients, + {1.5 * acts / 2**30:.1f} GiB "
            f"for {len(layers)} block(s)), more than the {have / 2**30:.1f} GiB available",
            "a smaller layout share (more --tp/--pp, --zero 3), fewer --blocks, or a shorter --seq-len",
        )


def step_without_data(built: RankModel) -> None:
    """The trainer's step with backward replaced by zero gradients wherever backward would leave one:
    the same gradient finishing (no-op collectives) and optimizer step, so the optimizer's lazily
    created state is allocated the way training allocates it. (Clipping is skipped: it allocates
    nothing that lasts, and its float64 temporaries would only raise the peak.)"""
    dp = built.plan.data_parallel
    dp.before_micro_batch(is_last=True)  # (ZeRO-2 allocates its flat gradient buffer here)
    with torch.no_grad():
        for _, p in dp.named_parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    built.plan.finish_gradients()
    dp.step()


def measured_state(built: RankModel) -> dict:
    """The ledger's bytes, as the trainer reads them after its first step (gradients and optimizer
    state both alive), plus the masters and flat buffers within them and each chunk's parameters."""
    dp = built.plan.data_parallel
    out: dict = dict(model_state_bytes(dp.tensors()))
    out["masters"] = held_bytes(master for _, master in dp.master_pairs)
    out["buffers"] = held_bytes(dp.flat_buffers())
    out["stages"] = [held_bytes(local_tensor(p) for p in chunk.parameters()) for chunk in built.chunks]
    return out


@contextlib.contextmanager
def mirrored_collectives():
    """Collectives that move data, made to fill their outputs as if every rank held this one's input
    (the fake group leaves them uninitialised); expert parallelism's count exchange delivers a
    perfectly balanced route. Values only: the shapes and bytes are the runtime's own."""
    real = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single")}

    def all_gather_single(output, input, *args, **kwargs):
        # (contiguous outputs: the runtime's; FSDP2 gathers in place, its input a slice of the output)
        output.view(-1, *input.shape).copy_(input.clone())

    def reduce_scatter_single(output, input, *args, **kwargs):
        output.copy_(input.reshape(-1, *output.shape)[0])

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if output_split_sizes is None and not output.is_floating_point():  # slots per expert
            total, n = int(input.sum()), output.numel()
            balanced = torch.full((n,), total // n, dtype=output.dtype)
            balanced[: total % n] += 1  # (every slot sent is received once)
            output.copy_(balanced.view_as(output))
        else:
            output.zero_()

    for name, fn in (
        ("all_gather_single", all_gather_single),
        ("reduce_scatter_single", reduce_scatter_single),
        ("all_to_all_single", all_to_all_single),
    ):
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def block_activations(built: RankModel, cfg: Config, layout: Layout, blocks: int) -> tuple[dict, dict]:
    """Forward and backward through the first `blocks` transformer blocks of this rank on one
    micro-batch at the real sequence length: {layer id: bytes saved for backward}, measured and the
    planner's."""
    precision, t = PRECISIONS[cfg.train.dtype], cfg.train
    chosen = [(chunk, lid, block) for chunk in built.chunks for lid, block in chunk.layers.items()][:blocks]
    chunk = chosen[0][0]
    tokens = t.seq_len // layout.cp // (layout.tp if layout.sp else 1)  # this rank's part of a sequence
    dtype = precision.weights if precision.autocast else precision.compute  # what the embedding hands on
    h = torch.randn(layout.micro_batch, tokens, cfg.model.dim, dtype=dtype, requires_grad=True)
    positions = chunk.positions if chunk.positions is not None else torch.arange(t.seq_len // layout.cp)
    cos, sin = rope_cos_sin(positions, cfg.model, dtype)
    ledger = ActivationLedger(built.chunks)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision.autocast else contextlib.nullcontext()
    built.plan.data_parallel.before_micro_batch(is_last=True)
    with mirrored_collectives():
        ledger.start()
        with autocast, built.plan.forward_context(ledger):
            x = h
            for _, _, block in chosen:
                x = block(x, cos, sin)
        ledger.stop()
        x.float().sum().backward()
    ids = [lid for _, lid, _ in chosen]
    want = activation_bytes_per_microbatch(
        cfg.model, layout, t.seq_len, t.dtype, [((int(i),), False, False) for i in ids]
    )
    return {i: ledger.per_layer.get(i, 0) for i in ids}, dict(zip(ids, want))


def run_dryrun(cfg: Config, world: int, *, rank: int, blocks: int = 0, init: bool = True) -> dict:
    """Build global rank `rank` of `cfg`'s layout on `world` ranks here and measure it; the figures
    `format_dryrun` prints."""
    check_rank(rank, world)
    if blocks < 0:
        raise ConfigError("--blocks", blocks, "must be >= 0", "e.g. --blocks 1")
    planner = planner_state(cfg, world, rank)
    check_room(cfg, planner, blocks, rank=rank)
    cfg.train.device = "cpu"
    with fake_process_group(rank=rank, world=world):
        start = time.perf_counter()
        built = build_rank(cfg, world, device="cpu", timeout_s=None, init=init)
        built_s, built_rss = time.perf_counter() - start, peak_memory_mb(built.device)  # (the high-water mark so far)
        step_without_data(built)
        step_s = time.perf_counter() - start - built_s
        measured = measured_state(built)
        layers = [list(chunk.layers) for chunk in built.chunks]
        acts = None
        if blocks:
            built.plan.data_parallel.zero_grad()
            acts = block_activations(built, cfg, planner["layout"], min(blocks, sum(map(len, layers))))
    return {
        "rank": rank,
        "world": world,
        "cfg": cfg,
        "init": init,
        "planner": planner,
        "measured": measured,
        "layers": layers,
        "build_s": built_s,
        "step_s": step_s,
        "build_rss_mb": built_rss,
        "peak_rss_mb": peak_memory_mb(built.device),
        "activations": acts,
        "init_stats": built.init_stats,
    }


def _row(label: str, got: int, want: int | None) -> str:
    if want is None:
        return f"  {label:<44}{got:>17,}  {'-':>17}"
    return f"  {label:<44}{got:>17,}  {want:>17,}" + ("" if got == want else f"  ({got - want:+,})")


def _layers(ids: list[str]) -> str:
    return f"layer {ids[0]}" if len(ids) == 1 else f"layers {ids[0]}-{ids[-1]}" if ids else "no layers"


def _init_line(stats) -> list[str]:
    """The initialisation's generator work next to what the rank holds (its tiles' rounding)."""
    if not stats.filled:
        return []
    return [
        f"  init: drew {stats.generated:,} values in {stats.tiles:,} tiles for the {stats.filled:,} elements "
        f"this rank holds (x{stats.generated / stats.filled:.3f})"
    ]


def format_dryrun(result: dict) -> str:
    """The report: model-state bytes measured | planner, per stage, activations; last line the verdict."""
    m, p, cfg = result["measured"], result["planner"], result["cfg"]
    layout, where, rank = p["layout"], p["where"], result["rank"]
    lines = [
        f"fived dryrun: rank {rank} of {result['world']} (pipeline rank {where['pp']}, ZeRO shard "
        f"{where['shard']}, expert-data index {where['edp']}) of {cfg.model.name} {layout.describe()}, "
        f"{cfg.train.dtype}, seq {cfg.train.seq_len}",
        f"  built in {result['build_s']:.1f} s ({'initialised' if result['init'] else 'not initialised: --no-init'}), "
        f"first optimizer step {result['step_s']:.1f} s; peak RSS {result['build_rss_mb'] / 1024:.2f} GiB "
        f"after the build, {result['peak_rss_mb'] / 1024:.2f} GiB in all",
        *_init_line(result["init_stats"]),
        f"  {'model-state bytes':<44}{'measured':>17}  {'planner':>17}",
    ]
    lines += [_row(kind, m[kind], p[kind]) for kind in STATE_KINDS]
    lines.append(_row("  of the optimizer: float32 masters", m["masters"], p["masters"]))
    lines.append(_row("flat buffers/buckets (with padding)", m["buffers"], None) + "  (hold the params/grads above)")
    stages = rank_stages(layout, where["pp"]) if layout.pp > 1 else [0]  # (pipeline stage numbers, not local)
    for stage, ids, got, want, chunk in zip(stages, result["layers"], m["stages"], p["stages"], p["chunks"]):
        ends = [name for name, here in (("embedding", chunk[1]), ("head", chunk[2])) if here]
        lines.append(
            _row(f"stage {stage}: {_layers(ids)}" + "".join(f" + {e}" for e in ends) + ", params", got, want["params"])
        )
    if result["activations"]:
        got, want = result["activations"]
        lines.append(
            f"  activation bytes per micro-batch (mbs {layout.micro_batch}, "
            f"{cfg.train.activation_checkpointing} checkpointing, the first {len(got)} of the rank's "
            f"{sum(map(len, result['layers']))} blocks): measured | planner"
        )
        for lid in got:
            err = (got[lid] - want[lid]) / want[lid] if want[lid] else 0.0
            lines.append(f"    layer {lid}: {got[lid]:,} | {want[lid]:,} ({err:+.2%})")
    total_m, total_p = sum(m[k] for k in STATE_KINDS), sum(p[k] for k in STATE_KINDS)
    lines.append(f"rank {rank} model-state bytes: measured {total_m}, planner {total_p}")
    return "\n".join(lines)
