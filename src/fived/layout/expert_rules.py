"""The layout rules of expert parallelism (`fived.layout.rules` asks them with the data rules): ep
divides the experts and the ranks it cuts, and the rules of MoE parallel folding (parallel.etp=1,
Megatron-Core's expert_tensor_parallel_size=1), each broken rule one `ConfigError` line with a valid
value. Folded, the routed experts are whole on every rank and ep spans a stage's dp*cp*tp ranks;
each tp rank routes its own sequence shard, which is why folding needs sequence parallelism (as
Megatron-Core requires of MoE under tp).
"""

from __future__ import annotations

import functools
import math

from fived.layout import batch_rules
from fived.layout.bounds import largest_divisor
from fived.layout.layout import Layout


def expert_rules(need, m, p, t, dp: int) -> None:
    """`need(ok, lambda: (field, value, rule, hint))` (`need.per_layout`: with `fived.layout.batch_rules`'
    rules) for every expert rule of `m` (model), `p` (parallel) and
    `t` (train) on `dp` data-parallel ranks."""
    folded, ranks = _expert_mesh(max(dp, 1), p.tp, p.cp, p.ep, p.etp)
    over = "dp*cp*tp (parallel.etp=1)" if folded else "dp*cp"

    def ep_ok() -> int:
        return largest_divisor(math.gcd(m.n_experts, ranks) if m.is_moe else ranks, p.ep)

    need(
        not m.is_moe or m.n_experts % p.ep == 0,
        lambda: ("parallel.ep", p.ep, f"must divide model.n_experts={m.n_experts}", f"e.g. --ep {ep_ok()}"),
    )
    need(
        dp >= 1 and ranks % p.ep == 0,
        lambda: ("parallel.ep", p.ep, f"must divide {over}={ranks}", f"e.g. --ep {ep_ok()}"),
    )
    need(
        p.ep == 1 or p.dp_replicate == 1,
        lambda: (
            "parallel.ep",
            p.ep,
            "expert parallelism with HSDP replicas is not supported yet",
            "use --ep 1, or --dp-replicate 1",
        ),
    )
    need(
        p.etp in (0, 1),
        lambda: (
            "parallel.etp",
            p.etp,
            "must be 0 (experts split over tp like the attention) or 1 (folded: whole experts, ep over dp*cp*tp)",
            "e.g. --parallel.etp 1",
        ),
    )
    if folded:
        _folding_rules(need, m, p, t)


@functools.lru_cache(maxsize=4096)
def _expert_mesh(dp: int, tp: int, cp: int, ep: int, etp: int) -> tuple[bool, int]:
    """(folded, the ranks ep spans) of these sizes, read from `Layout` (the expert mesh's one source;
    built once per sizes: the planner asks the rules of ~10^4 layouts)."""
    layout = Layout(dp=dp, tp=tp, cp=cp, ep=ep, etp=etp)
    return layout.folded, layout.expert_ranks


def _folding_rules(need, m, p, t) -> None:
    need(
        m.is_moe,
        lambda: (
            "parallel.etp",
            p.etp,
            f"folds routed experts: it needs a mixture-of-experts model (model.name={m.name} is dense)",
            "drop --parallel.etp, or use a MoE model such as --model tiny-moe",
        ),
    )
    if need.per_layout:
        batch_rules.folded_sp(need, p)
    # Muon's exchange places a routed expert's pieces by (ep, edp) over dp*cp only (fived.layout.muon_plan)
    need(
        t.optimizer != "muon",
        lambda: (
            "parallel.etp",
            p.etp,
            "cannot run with train.optimizer=muon yet (Muon's plan places experts over dp*cp, not dp*cp*tp)",
            "use --train.optimizer adamw, or --parallel.etp 0",
        ),
    )
