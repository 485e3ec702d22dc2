"""One rank's share of the model, built: the mesh, its pipeline stages on meta, the parallel plan, the
materialised shards initialised by placement, the data-parallel wrapping and the optimizer. The
trainer and `fived dryrun` both build a rank here, so a dry run measures what training allocates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fived.config import Config
from fived.layout.spec import layout_specs
from fived.layout.stages import stage_rank
from fived.model.init import InitStats, init_weights
from fived.model.mtp import mtp_loss_scales
from fived.model.transformer import MoE, build_model, keep_buffers_float32, materialize
from fived.parallel import ParallelPlan, parallelize
from fived.parallel.mesh import Mesh, build_dtype
from fived.parallel.mtp_embedding import link_mtp_embedding
from fived.parallel.pipeline import Pipeline


@dataclass
class RankModel:
    """One rank's share of the model and what the optimizer needs, as `build_rank` leaves it."""

    mesh: Mesh
    device: torch.device
    pipeline: Pipeline | None  # this rank's pipeline stages (no schedule yet), if pp > 1
    chunks: list  # the model, or this rank's stages
    plan: ParallelPlan  # its data_parallel holds the flat buffers or shards
    modules: list  # what forward is called on (DDP wraps)
    optimizer: torch.optim.Optimizer
    init_stats: InitStats  # this rank's generator work at initialisation


def build_rank(cfg: Config, world: int, *, device: str, timeout_s: float | None, init: bool = True) -> RankModel:
    """Build this rank's model state: the mesh, its pipeline stages on meta, the parallel plan, the
    materialised and initialised shards, the data-parallel wrapping and the optimizer. The trainer
    and `fived dryrun` both call this, so a dry run measures what training allocates. `timeout_s`:
    the collective timeout the mesh's groups carry (None: the default group's backend and timeout,
    as under a fake process group). init=False leaves the weights uninitialised (`fived dryrun
    --no-init`: the allocations without the cost of drawing every initial value)."""
    mesh = Mesh.from_config(cfg, world).build(device, timeout_s)
    where = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    # The dtype the model is built in (ZeRO-3 keeps bf16 runs' float32 masters as its sharded
    # parameters and gathers them in bf16; see fived.parallel.mesh.build_dtype).
    param_dtype = build_dtype(cfg)
    pipeline = Pipeline(cfg, mesh) if mesh.pp > 1 else None
    chunks = pipeline.build_chunks(param_dtype) if pipeline else [build_model(cfg.model, "meta", param_dtype)]
    for moe in (m for c in chunks for m in c.modules() if isinstance(m, MoE)):
        # (before parallelize: tensor parallelism divides it by tp)
        moe.aux_loss_scale = cfg.model.aux_loss_coef / cfg.train.global_batch
    for chunk in chunks:
        if chunk.mtp is not None:
            chunk.mtp.loss_scales = mtp_loss_scales(cfg.model, cfg.train.global_batch, cfg.train.seq_len)
    plan = parallelize(chunks, mesh, cfg)  # on the meta device: nothing allocated yet
    stats = InitStats()
    for chunk in chunks:
        materialize(chunk, where)
        if init:  # each rank draws only the tiles of its own pieces (fived.model.init)
            init_weights(chunk, cfg.train.seed, plan.init_placement, stats)
        keep_buffers_float32(chunk)  # router biases move by small steps: not in bf16
    if pipeline is not None and cfg.model.mtp_depth:
        plan.mtp_link = _link_mtp_embedding(cfg, mesh, pipeline, chunks, plan, where, param_dtype)
    modules = plan.data_parallel.wrap(chunks)
    optimizer = plan.data_parallel.build_optimizer(plan.placements)
    return RankModel(mesh, where, pipeline, chunks, plan, modules, optimizer, stats)


def _link_mtp_embedding(cfg: Config, mesh: Mesh, pipeline: Pipeline, chunks, plan: ParallelPlan, where, dtype):
    """The last stage's copy of the embedding for multi-token prediction (fived.parallel.mtp_embedding)."""
    specs = layout_specs(cfg.model, mesh.layout)
    shape = specs["tok_embeddings.weight"].local_box(tp_rank=mesh.rank("tp") if mesh.tp > 1 else 0)[1]
    last_rank = stage_rank(pipeline.n_stages - 1, mesh.pp, mesh.layout.pp_schedule)
    link = link_mtp_embedding(
        chunks, mesh, has_first=0 in pipeline.stage_ids, last_rank=last_rank, shape=shape, device=where, dtype=dtype
    )
    if link is not None and link.copy is not None and plan.tensor_parallel is not None:
        plan.tensor_parallel.hook_embedding(link.copy)
    return link
