"""Muon (MomentUm Orthogonalized by Newton-Schulz; Keller Jordan 2024, scaled up by Moonlight, Liu et
al. 2025) for the hidden weight matrices, torch's AdamW for everything else, as one optimizer.

Per step, for each Muon matrix W with (clipped) gradient G and momentum buffer M:
    M <- beta M + (1 - beta) G                      (train.muon_momentum)
    D <- beta M + (1 - beta) G  with Nesterov, else M  (train.muon_nesterov)
    O <- Newton-Schulz(D): X = D / (||D||_F + 1e-7), then per iteration X <- a X + (b A + c A^2) X with
         A = X X^T (on the wide orientation), train.muon_ns_steps iterations of (a, b, c)
         (train.muon_ns_coefficients), in the run's compute dtype (float64 in `fived verify`)
    W <- W (1 - lr wd) - lr s O, s the update scale of a fan_out x fan_in matrix (train.muon_scale)
with lr train.muon_lr (train.lr when 0). A routed experts' tensor is one matrix per expert. The
embedding, the head, norms and the router stay with AdamW (train.lr, betas, eps, weight decay as
train.optimizer=adamw sets them), under the same learning-rate schedule (each group's lr times the
schedule's factor): one `param_groups` list, one `state` (checkpoints hold each Muon matrix's
`momentum_buffer` by canonical name, placed like its parameter, as AdamW's moments).

Sharded: each rank keeps momentum for the pieces it stores; `fived.parallel.muon_exchange` assembles
every matrix whole at one owner, which orthogonalises it once, and returns each rank its pieces
(see `fived.layout.muon_plan`). A single device runs the same code with itself as every owner.
"""

from __future__ import annotations

import math

import torch

from fived.config import TrainConfig
from fived.layout.bounds import ns_coefficients
from fived.model.ledger import local_tensor


def update_scale(rule: str, fan_out: int, fan_in: int) -> float:
    """What an orthogonalised update of a fan_out x fan_in matrix is multiplied by: "rms" gives it
    AdamW's typical update RMS, 0.2 (Moonlight: AdamW's lr and weight decay carry over); "spectral"
    sqrt(max(1, fan_out/fan_in)) (Keller Jordan's Muon); "none" 1."""
    if rule == "rms":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    if rule == "spectral":
        return math.sqrt(max(1.0, fan_out / fan_in))
    return 1.0


def newton_schulz(
    matrix: torch.Tensor, coefficients: list[tuple[float, float, float]], eps: float = 1e-7
) -> torch.Tensor:
    """The orthogonalised `matrix` (approximately U V^T of its SVD, singular values pushed toward 1),
    in its own dtype. Iterates on the wide orientation, so A = X X^T is the smaller Gram matrix."""
    tall = matrix.shape[0] > matrix.shape[1]
    x = matrix.mT if tall else matrix
    x = x / (torch.linalg.matrix_norm(x) + eps)
    for a, b, c in coefficients:  # (two fused multiply-adds: X, A and b A + c A^2 alive, then the next X)
        gram = x @ x.mT
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon for `matrices` [(canonical name, tensor the optimizer updates)] beside `adamw` (for the
    other tensors, as `fived.optim.adamw.build_optimizer` makes it), with one schedule and one state.
    `exchange`: a `fived.parallel.muon_exchange.MatrixExchange`."""

    STATE = ("momentum_buffer",)

    def __init__(self, matrices: list[tuple[str, torch.Tensor]], adamw: torch.optim.AdamW, t: TrainConfig, exchange):
        self.adamw = adamw
        self.names = [name for name, _ in matrices]
        muon = {
            "params": [p for _, p in matrices],
            "lr": t.muon_lr or t.lr,
            "weight_decay": t.weight_decay,
            "momentum": t.muon_momentum,
            "nesterov": t.muon_nesterov,
            "muon": True,
        }
        # AdamW's group dicts themselves: the schedule's lr reaches both optimizers
        super().__init__(self.adamw.param_groups + [muon], {"lr": t.lr, "muon": False})
        self.adamw.state = self.state  # one state: checkpoints and the memory ledger read optimizer.state
        self.exchange = exchange
        self.coefficients = ns_coefficients(t.muon_ns_coefficients, t.muon_ns_steps)
        self.scales = {name: update_scale(t.muon_scale, *exchange.fans(name)) for name in self.names}
        self._matrices = {id(p) for _, p in matrices}

    def orthogonalizes(self, param: torch.Tensor) -> bool:
        return id(param) in self._matrices

    def fresh_state(self, param: torch.Tensor) -> dict:
        """The state DCP fills when a checkpoint is loaded into a fresh optimizer."""
        return {"momentum_buffer": torch.zeros_like(param)}

    @torch.no_grad()
    def step(self, closure=None):
        self.adamw.step()
        group = self.param_groups[-1]
        beta, lr, decay, nesterov = group["momentum"], group["lr"], group["weight_decay"], group["nesterov"]
        stored = {}  # name -> (gradient, momentum, weight) as this rank stores them
        for name, p in zip(self.names, group["params"]):
            state = self.state[p]
            if not state:
                state.update(self.fresh_state(p))
            buf = local_tensor(state["momentum_buffer"])
            grad = local_tensor(p.grad) if p.grad is not None else torch.zeros_like(buf)
            buf.lerp_(grad, 1 - beta)
            weight = local_tensor(p)
            weight.mul_(1 - lr * decay)  # (decoupled: before the update, as W (1 - lr wd) - lr s O)
            stored[name] = (grad, buf, weight)
        x = self.exchange

        def direction(name: str, box) -> torch.Tensor:
            grad, buf, _ = stored[name]
            momentum = x.view(name, buf, box)
            return (x.view(name, grad, box).lerp(momentum, beta) if nesterov else momentum).to(x.dtype)

        def apply(name: str, box, update: torch.Tensor) -> None:
            weight = x.view(name, stored[name][2], box)
            weight.add_(update.to(weight.dtype), alpha=-lr * self.scales[name])

        x.orthogonalize(direction, lambda m: newton_schulz(m, self.coefficients), apply)
