"""`fived generate --nproc N --tp T [--pp P --ep E]`: KV-cached generation of a batch of prompts on
ranks, with the parallel modules training uses (`fived.parallel.parallelize`: tensor parallelism's
regions and vocab-parallel embedding, the pipeline's stage split, expert parallelism's all-to-all),
so that the serving planner's memory model (`fived.planner.serve_model`) is measured on the runtime.

- The ranks are dp x pp x tp as training lays them out; each data-parallel rank generates its share of
  the prompts (with ep, dp ranks hold E/ep routed experts each and step together: data-parallel
  attention with expert parallelism, as serving engines run MoE models).
- A rank's prompts are left-padded to the longest; a padded prompt's positions start at its padding
  (rotary attention depends only on position differences) and its padding is masked from every query.
- Each step runs the pipeline ranks one after another: the first stage embeds, each stage sends its
  hidden states to the next, the last gathers the vocab-parallel logits of each sequence's last
  position over tp, picks the next tokens and sends them to the first stage.
- Every rank reports the bytes its caches hold next to `kv_cache_bytes`, the prefill time (the barrier
  before the prompt to its first tokens) and each decode step's time, as the last stage saw them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fived.config import Config, ConfigError, ModelConfig, build_config
from fived.layout.rules import layout_errors
from fived.parallel import comm
from fived.tools.generate import Sampling, cache_core, next_token

GENERATE_TIMEOUT_S = 300.0  # per collective


@dataclass
class RankGeneration:
    """What one rank measured (and, on a last-stage rank of tp rank 0, what its prompts generated)."""

    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    sequences: int
    positions: int  # per sequence: the padded prompt and every output token (a global layer caches all)
    layers: int
    windowed: int  # of the layers: windowed ones, whose rolling caches hold the window's last positions
    kv_bytes: int  # measured: the caches' storage
    kv_formula: float  # fived.planner.serve_model.kv_cache_bytes for the same shapes
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)
    generated: list[list[int]] | None = None


# `fived generate`'s flag for each layout field training's rules name
GENERATE_FLAGS = {"parallel.tp": "--tp", "parallel.pp": "--pp", "parallel.ep": "--ep", "parallel.dp": "--nproc"}


def generation_config(
    model: ModelConfig, world: int, *, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str = "float32", seed: int = 0
) -> Config:
    """The config the generation ranks build from: training's layout rules checked, each refusal one
    line naming `fived generate`'s flag."""
    if world % (tp * pp):
        raise ConfigError("--nproc", world, f"must be a multiple of --tp x --pp = {tp * pp}", f"e.g. --nproc {tp * pp}")
    if model.is_moe and model.capacity_factor > 0:  # (dropless routing only: padding would take capacity)
        raise ConfigError(
            "model.capacity_factor",
            model.capacity_factor,
            "generation on ranks batches left-padded "
            "prompts, whose padding would take the experts' capacity: only dropless MoE (0) runs there",
            "generate each prompt alone in one process (one --prompt, no --nproc)",
        )
    cfg = build_config(
        overrides={
            "parallel.tp": tp,
            "parallel.pp": pp,
            "parallel.ep": ep,
            "train.dtype": dtype,
            "train.seed": seed,
            "train.microbatches": pp,
        }
    )
    cfg.model = model
    dp = world // (tp * pp)
    cfg.train.global_batch = dp * pp
    errors = layout_errors(cfg, world)
    if errors:
        e = errors[0]
        raise ConfigError(GENERATE_FLAGS.get(e.field, e.field), e.value, e.rule, e.hint)
    cfg.parallel.dp = dp
    return cfg


def check_prompts(prompts: list[list[int]], dp: int) -> None:
    if not prompts or any(not p for p in prompts):
        raise ConfigError("--prompt", "(empty)", "every prompt must encode to at least one token", "give some text")
    if len(prompts) % dp:
        raise ConfigError(
            "--prompt",
            f"{len(prompts)} prompts",
            f"must divide among dp={dp} data-parallel ranks",
            f"give {dp * (len(prompts) // dp + 1)} prompts, or fewer ranks",
        )


def generate_on_ranks(
    cfg: Config,
    world: int,
    prompts: list[list[int]],
    sampling: Sampling,
    *,
    source: str = "",
    stop_ids: frozenset = frozenset(),
    device: str = "cpu",
    warmup: int = 0,
) -> list[RankGeneration]:
    """Run the generation on `world` fresh ranks (after `warmup` untimed ones); each rank's report."""
    from fived.launch.ranks import run_ranks

    check_prompts(prompts, cfg.parallel.dp)
    return run_ranks(
        world,
        generate_on_rank,
        cfg,
        prompts,
        sampling,
        source,
        stop_ids,
        warmup,
        timeout_s=GENERATE_TIMEOUT_S,
        device=device,
    )


def generated_ids(reports: list[RankGeneration]) -> list[list[int]]:
    """Every prompt's generated ids, in the prompts' order (from the last stage's tp rank 0 of each dp rank)."""
    out = {}
    for r in reports:
        if r.generated is not None:
            out[r.dp_rank] = r.generated
    return [ids for dp in sorted(out) for ids in out[dp]]


@torch.no_grad()
def generate_on_rank(
    cfg: Config, prompts: list[list[int]], sampling: Sampling, source: str, stop_ids: frozenset, warmup: int = 0
) -> RankGeneration:
    """One rank's part (the default process group is up); `warmup` untimed generations first (a fresh
    process's first forward pays one-time costs: allocations, kernel selection, connections)."""
    ranked = build_generation_rank(cfg, source)
    mine = _share(prompts, cfg.parallel.dp, ranked.dp_rank)
    for _ in range(warmup):
        ranked.generate(mine, sampling)
    out, caches, prefill_s, decode_s = ranked.generate(mine, sampling)
    from fived.planner.serve_model import kv_cache_bytes

    positions = max(len(p) for p in mine) + sampling.max_new_tokens
    formula = kv_cache_bytes(
        cfg.model,
        tp=cfg.parallel.tp,
        layers=[int(lid) for lid in ranked.chunk.layers],
        sequences=len(mine),
        positions=positions,
        element_bytes=ranked.element_bytes,
    )
    keep = ranked.last and ranked.tp_rank == 0
    return RankGeneration(
        dist.get_rank(),
        ranked.dp_rank,
        ranked.pp_rank,
        ranked.tp_rank,
        len(mine),
        positions,
        len(caches),
        sum(1 for c in caches if c.window),
        sum(c.nbytes for c in caches),
        formula,
        prefill_s,
        decode_s,
        [_until_stop(seq, stop_ids) for seq in out] if keep else None,
    )


def _share(prompts: list[list[int]], dp: int, dp_rank: int) -> list[list[int]]:
    per = len(prompts) // dp
    return prompts[dp_rank * per : (dp_rank + 1) * per]


def _until_stop(ids: list[int], stop_ids: frozenset) -> list[int]:
    """The ids up to and including the first stop id (as one-process generation ends)."""
    for i, token in enumerate(ids):
        if token in stop_ids:
            return ids[: i + 1]
    return ids


class GenerationRank:
    """One rank's model share (its pipeline stage, cut by tp and ep as training cuts it) and one step
    of generation through the pipeline."""

    def __init__(self, cfg: Config, mesh, chunk, device: torch.device):
        self.cfg, self.mesh, self.chunk, self.device = cfg, mesh, chunk, device
        self.tp_rank = mesh.rank("tp") if mesh.tp > 1 else 0
        self.pp_rank = mesh.rank("pp") if mesh.pp > 1 else 0
        self.dp_rank = mesh.rank("dp") if mesh.dp > 1 else 0
        self.first, self.last = self.pp_rank == 0, self.pp_rank == mesh.pp - 1
        self.dtype = next(chunk.parameters()).dtype
        self.element_bytes = torch.finfo(self.dtype).bits // 8

    def generate(self, prompts: list[list[int]], sampling: Sampling):
        """(each prompt's generated ids, the KV caches, prefill seconds, each decode step's seconds) for
        this rank's prompts, left-padded into one batch, with fresh caches."""
        longest = max(len(p) for p in prompts)
        positions = longest + sampling.max_new_tokens
        tokens = torch.zeros((len(prompts), longest), dtype=torch.long, device=self.device)
        real = torch.zeros((len(prompts), positions), dtype=torch.bool, device=self.device)
        for i, prompt in enumerate(prompts):
            tokens[i, longest - len(prompt) :] = torch.tensor(prompt)
            real[i, longest - len(prompt) :] = True
        caches = [cache_core(block.attention, positions, real) for block in self.chunk.layers.values()]
        for block, cache in zip(self.chunk.layers.values(), caches):
            block.attention.core = cache
        generators = [torch.Generator().manual_seed(sampling.seed) for _ in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        dist.barrier()
        start = time.perf_counter()
        chosen = self.step(tokens, torch.arange(longest, device=self.device), sampling, generators)
        prefill_s, decode_s = time.perf_counter() - start, []
        for step in range(1, sampling.max_new_tokens):
            for seq, token in zip(out, chosen.tolist()):
                seq.append(token)
            start = time.perf_counter()
            position = torch.tensor([longest + step - 1], device=self.device)
            chosen = self.step(chosen[:, None], position, sampling, generators)
            decode_s.append(time.perf_counter() - start)
        for seq, token in zip(out, chosen.tolist()):
            seq.append(token)
        return out, caches, prefill_s, decode_s

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, sampling: Sampling, generators) -> torch.Tensor:
        """The next token of each sequence (on every rank of the first and last stages), after a
        forward of `tokens` ([sequences, new positions]) at `positions`."""
        b, s = tokens.shape
        group = self.mesh.group("pp")  # (sends and receives between stages: only with pp > 1)
        x = tokens
        if not self.first:
            x = torch.empty((b, s, self.cfg.model.dim), dtype=self.dtype, device=self.device)
            comm.exchange([], [(x, dist.get_global_rank(group, self.pp_rank - 1))], group).wait()
        h = self.chunk(x, positions=positions)
        if not self.last:
            comm.exchange([(h.contiguous(), dist.get_global_rank(group, self.pp_rank + 1))], [], group).wait()
        chosen = torch.empty(b, dtype=torch.long, device=self.device)
        if self.last:
            logits = self._full_logits(h[:, -1])
            chosen = torch.tensor(
                [next_token(row, sampling, g) for row, g in zip(logits, generators)], device=self.device
            )
        if self.mesh.pp > 1 and self.last:
            comm.exchange([(chosen, dist.get_global_rank(group, 0))], [], group).wait()
        elif self.mesh.pp > 1 and self.first:
            comm.exchange([], [(chosen, dist.get_global_rank(group, self.mesh.pp - 1))], group).wait()
        return chosen

    def _full_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[sequences, vocabulary] from this tp rank's vocabulary slice (padding dropped)."""
        vocab = self.cfg.model.vocab_size
        if self.mesh.tp == 1:
            return local[:, :vocab]
        tp, b = self.mesh.tp, local.shape[0]
        out = local.new_empty((tp * b, local.shape[1]))
        comm.all_gather_single(out, local.contiguous(), self.mesh.group("tp"))
        return out.view(tp, b, -1).permute(1, 0, 2).reshape(b, -1)[:, :vocab]


def build_generation_rank(cfg: Config, source: str) -> GenerationRank:
    """This rank's mesh and model share, its weights initialised by placement (`train.seed`) or read
    from `source` (a run, checkpoint or Hugging Face directory) by placement, as `--init-from` reads."""
    from fived.model.init import init_weights
    from fived.model.transformer import build_model, keep_buffers_float32, materialize
    from fived.parallel import parallelize
    from fived.parallel.mesh import DTYPES, Mesh
    from fived.parallel.pipeline import Pipeline
    from fived.parallel.process_group import device_type

    device = device_type(cfg.train.device)
    mesh = Mesh.from_config(cfg, dist.get_world_size()).build(device, GENERATE_TIMEOUT_S)
    where = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    dtype = DTYPES[cfg.train.dtype]
    chunks = Pipeline(cfg, mesh).build_chunks(dtype) if mesh.pp > 1 else [build_model(cfg.model, "meta", dtype)]
    plan = parallelize(chunks, mesh, cfg)
    (chunk,) = chunks
    materialize(chunk, where)
    if source:
        _load_weights(chunk, plan, source)
    else:
        init_weights(chunk, cfg.train.seed, plan.init_placement)
    keep_buffers_float32(chunk)
    chunk.eval()
    return GenerationRank(cfg, mesh, chunk, where)


def _load_weights(chunk, plan, source: str) -> None:
    from fived.checkpoint.dcp_io import ShardedValue
    from fived.hf.init import load_initial_weights
    from fived.model.transformer import canonical_name

    values = {}
    for raw, tensor in [*chunk.named_parameters(), *chunk.named_buffers()]:
        name = canonical_name(raw)
        tensor.data.zero_()  # (the vocabulary's padding rows stay zero)
        place = plan.init_placement(name) if name in plan.global_shapes else plan.placements[name]
        values[name] = ShardedValue(place.global_shape, place.pieces(tensor.data), place.replica == 0, tensor.dtype)
    load_initial_weights(source, values, {canonical_name(raw) for raw, _ in chunk.named_buffers()})


def format_report(reports: list[RankGeneration], cfg: Config) -> str:
    """Per rank: the KV-cache bytes measured next to `kv_cache_bytes`, the prefill time and the time per
    output token (median of the decode steps), as the last pipeline stage measured them."""
    from statistics import median

    from fived.layout.spec import cached_positions

    p = cfg.parallel
    lines = [f"generation on {len(reports)} ranks (dp{p.dp} tp{p.tp} pp{p.pp} ep{p.ep}, {cfg.train.dtype}):"]
    cached = "kv latent and rope key" if cfg.model.is_mla else "keys and values"
    for r in reports:
        window = cached_positions(cfg.model.sliding_window, r.positions)
        kept = (r.layers - r.windowed) * r.positions + r.windowed * window
        per = r.kv_formula // max(1, r.sequences * kept)
        shape = f"{r.layers} layers x {r.sequences} sequences x {r.positions} positions"
        if r.windowed:  # (a rolling cache keeps a windowed layer's last `window` positions)
            shape = (
                f"{r.sequences} sequences x ({r.layers - r.windowed} global layers x {r.positions} positions + "
                f"{r.windowed} windowed x {window})"
            )
        step = (
            f"{median(r.decode_s) * 1e3:.2f} ms per output token (median of {len(r.decode_s)} steps)"
            if r.decode_s
            else "no decode step"
        )
        lines.append(
            f"  rank {r.rank} (dp {r.dp_rank}, pp {r.pp_rank}, tp {r.tp_rank}): KV cache {r.kv_bytes:,} bytes "
            f"measured | {r.kv_formula:,} formula ({shape} x {per} bytes of {cached}); "
            f"prefill {r.prefill_s * 1e3:.2f} ms, "
            f"{step}"
        )
    return "\n".join(lines)
