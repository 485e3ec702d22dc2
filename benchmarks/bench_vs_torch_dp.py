"""Time fived's data-parallel training step against the plain torch loops a user would write.

On N CPU ranks (gloo, one thread each; `fived.launch.ranks.run_ranks` forks them), in ONE process group:

  stage 0: fived's Trainer with parallel.zero=0      vs  DistributedDataParallel(model) + AdamW
  stage 3: fived's Trainer with parallel.zero=3      vs  fully_shard(each block), fully_shard(root) + AdamW

Every runner uses the same fived Transformer, the same initial weights (`init_weights`, seeded by
name), the same float32 dtype, the same global batch (`GlobalBatchSampler` over the bundled corpus;
each rank takes its 1/N slice of the same rows), one micro-batch, mean cross-entropy over the global
batch, gradient clipping by global norm at 1.0 and torch.optim.AdamW. The torch loops are the
textbook ones: forward, `F.cross_entropy`, backward, `clip_grad_norm_`, `step`, `zero_grad`.

The first step is a check: fived's logged loss and gradient norm must equal the peer's (averaged
over ranks) for each stage, or the script exits 1. Then warmup steps are run and discarded, and the
timed steps interleave all runners in the same processes (order reversed every other step). Each
step is timed on every rank with time.perf_counter after a dist.barrier(); a step's time is the max
over ranks (the slowest rank defines it) and the table reports the median over steps. The last two
lines are the ratios fived / torch of the median step times.

    python benchmarks/bench_vs_torch_dp.py                       # 4 ranks, dim 256, 4 layers
    python benchmarks/bench_vs_torch_dp.py --stages 3 --steps 60 --global-batch 32
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")  # run_ranks sets it per rank too

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fived.config import build_config
from fived.launch.ranks import run_ranks

STAGES = {0: ("fived zero0", "torch DDP"), 3: ("fived zero3", "torch FSDP2")}
# First-step agreement (float32; only the order of the reductions differs).
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks = data-parallel size")
    p.add_argument("--stages", default="0,3", help="comma-separated ZeRO stages to compare: 0, 3 or 0,3")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=688)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, all ranks")
    p.add_argument("--steps", type=int, default=30, help="timed steps per runner")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per runner (after the check step)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    try:
        args.stage_list = sorted({int(s) for s in args.stages.split(",") if s.strip()})
    except ValueError:
        p.error(f"--stages {args.stages}: give 0, 3 or 0,3")
    if not args.stage_list or any(s not in STAGES for s in args.stage_list):
        p.error(f"--stages {args.stages}: give 0, 3 or 0,3")
    if args.world < 2 or args.global_batch % args.world:
        p.error(f"--world must be >= 2 and divide --global-batch ({args.global_batch})")
    if min(args.steps, args.seq_len - 1) < 1 or args.warmup < 0:
        p.error("--steps >= 1, --seq-len >= 2, --warmup >= 0")
    return args


def make_config(args: argparse.Namespace, zero: int):
    return build_config(
        overrides={
            "model.name": "tiny",
            "model.dim": args.dim,
            "model.n_layers": args.layers,
            "model.n_heads": args.heads,
            "model.n_kv_heads": args.kv_heads,
            "model.ffn_dim": args.ffn_dim,
            "model.vocab_size": args.vocab,
            "parallel.dp": args.world,
            "parallel.zero": zero,
            "train.dtype": "float32",
            "train.seq_len": args.seq_len,
            "train.global_batch": args.global_batch,
            "train.microbatches": 1,
            "train.grad_clip": 1.0,
            "train.seed": args.seed,
            "train.steps": 1 + args.warmup + args.steps,
            "train.log_every": 10**9,
        }
    )


def _value(t) -> float:
    """A (possibly DTensor) scalar as a float."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def torch_runner(cfg, stage: int):
    """The hand-written loop: DDP (stage 0) or FSDP2 (stage 3) around the same Transformer."""
    from fived.data.loader import GlobalBatchSampler, load_tokens
    from fived.model.init import init_weights
    from fived.model.transformer import build_model

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg.model, "cpu")
    init_weights(model, cfg.train.seed)
    if stage == 0:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    t = cfg.train
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay
    )
    sampler = GlobalBatchSampler(load_tokens(None), t.seq_len, t.global_batch, t.seed)

    def step(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = sampler.local_batch_at(s, rank, world)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), norm

    return step


def rank_main(args: argparse.Namespace) -> dict:
    from fived.training.trainer import Trainer

    # torch 2.13 deprecates DDP's broadcast_buffers, which fived's stage 0 passes: not our subject here.
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    world = dist.get_world_size()
    runners, checks = {}, {}
    for stage in args.stage_list:
        cfg = make_config(args, stage)
        ours_name, peer_name = STAGES[stage]
        trainer = Trainer(cfg, log=False)
        runners[ours_name] = trainer.step
        runners[peer_name] = torch_runner(cfg, stage)

    # Check step (step 0, same batch and weights for all): loss and gradient norm must agree.
    for name, fn in runners.items():
        out = fn(0)
        if isinstance(out, dict):  # fived: already the global mean loss and global norm
            checks[name] = (out["loss"], out["grad_norm"])
        else:
            loss, norm = out
            total = loss.double().reshape(1)
            dist.all_reduce(total)  # untimed: mean over ranks of equal-size local means
            checks[name] = (total.item() / world, _value(norm))

    for s in range(1, 1 + args.warmup):
        for fn in runners.values():
            dist.barrier()
            fn(s)

    names = list(runners)
    times: dict[str, list[float]] = {k: [] for k in names}
    gc.collect()
    gc.disable()
    try:
        for i in range(args.steps):
            s = 1 + args.warmup + i
            for name in names if i % 2 == 0 else names[::-1]:
                dist.barrier()
                t0 = time.perf_counter()
                runners[name](s)
                times[name].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return {"times": times, "checks": checks}


def main() -> int:
    args = parse_args()
    cfg = make_config(args, 0)
    m = cfg.model
    from fived.model.transformer import count_params

    print(
        f"fived vs torch data parallel | torch {torch.__version__} | {args.world} ranks, gloo, "
        f"OMP_NUM_THREADS=1 | float32 | cpus {os.cpu_count()}"
    )
    print(
        f"model: dim={m.dim} n_layers={m.n_layers} n_heads={m.n_heads} n_kv_heads={m.n_kv_heads} "
        f"ffn_dim={m.ffn_dim} vocab={m.vocab_size} params={count_params(m) / 1e6:.2f}M"
    )
    print(
        f"global batch {args.global_batch} x seq_len {args.seq_len} ({args.global_batch // args.world} "
        f"sequences per rank, 1 micro-batch) | steps {args.steps} timed, {args.warmup} warmup, interleaved"
    )
    if (os.cpu_count() or 1) < args.world:
        print(
            f"warning: {os.cpu_count()} CPUs for {args.world} ranks: ranks share cores, timings are noisy",
            file=sys.stderr,
        )

    results = run_ranks(args.world, rank_main, args, timeout_s=1800.0)

    ok = True
    print()
    for stage in args.stage_list:
        ours, peer = STAGES[stage]
        (l0, n0), (l1, n1) = results[0]["checks"][ours], results[0]["checks"][peer]
        good = abs(l0 - l1) <= LOSS_RTOL * abs(l1) and abs(n0 - n1) <= NORM_RTOL * abs(n1)
        ok &= good
        print(
            f"stage {stage} first step: loss {ours} {l0:.7f}  {peer} {l1:.7f} | "
            f"grad norm {n0:.6f}  {n1:.6f} | {'agree' if good else 'DISAGREE'}"
        )
    if not ok:
        print("SANITY CHECK FAILED: fived and torch do not compute the same step", file=sys.stderr)
        return 1

    # A step's time is the slowest rank's; then median / min / max over the timed steps.
    names = list(results[0]["times"])
    step_max = {k: [max(r["times"][k][i] for r in results) for i in range(args.steps)] for k in names}
    med = {k: statistics.median(v) for k, v in step_max.items()}
    tok = args.global_batch * args.seq_len
    print()
    print(f"{'runner':<14}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'tokens/s':>11}")
    for k in names:
        v = step_max[k]
        print(f"{k:<14}{med[k] * 1e3:>11.2f}{min(v) * 1e3:>9.2f}{max(v) * 1e3:>9.2f}{tok / med[k]:>11.0f}")
    for stage in args.stage_list:
        ours, peer = STAGES[stage]
        print(f"ratio stage {stage} (fived / {peer}, median step time): {med[ours] / med[peer]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
