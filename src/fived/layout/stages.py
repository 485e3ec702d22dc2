"""Pipeline stages: which layers each stage holds and which pipeline rank runs each stage — the
rules the runtime builds its stages by and the planner prices them by (plain Python).

- Stages are contiguous layers, balanced by cost (a layer's FLOPs per token; the output head counts
  on the last stage), or as `parallel.pp_layers` says ("3,1,2,2"). The embedding lives on the first
  stage, the final norm, head and loss on the last.
- Stage s runs on pp rank s % pp for looped schedules, and on ranks 0..pp-1 then back pp-1..0 for
  the V-shaped ones (zbv, dualpipev).
"""

from __future__ import annotations

import weakref
from functools import lru_cache

from fived.config import ModelConfig
from fived.layout.layout import V_SHAPED, Layout

Chunk = tuple[tuple[int, ...], bool, bool]  # (layer ids, holds the embedding, holds the head)


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def layer_costs(cfg: ModelConfig) -> tuple[list[int], int]:
    """FLOPs-proportional cost of each layer, and of the output head (on the last stage, with the
    multi-token prediction modules: each a block, its 2d -> d projection and the head again)."""
    d = cfg.dim
    attn = d * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    dense = 3 * d * cfg.ffn_dim
    moe = 3 * d * cfg.expert_dim * (cfg.top_k + cfg.n_shared_experts) + d * cfg.n_experts
    costs = [attn + (moe if cfg.is_moe and i >= cfg.n_dense_layers else dense) for i in range(cfg.n_layers)]
    mtp = [attn + (moe if cfg.is_moe and i >= cfg.n_dense_layers else dense) for i in mtp_layer_ids(cfg)]
    return costs, d * cfg.vocab_size + sum(mtp) + cfg.mtp_depth * (2 * d * d + d * cfg.vocab_size)


def mtp_layer_ids(cfg: ModelConfig) -> range:
    """The layer ids of the multi-token prediction modules' blocks (after the main model's)."""
    return range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth)


def split_layers(cfg: ModelConfig, n_stages: int, override: str = "") -> list[list[int]]:
    """Contiguous layer ids per stage minimising the most expensive stage, then (among equal maxima)
    the sum of squared stage costs — exact, by dynamic programming over split points — or the
    explicit counts of `override`."""
    if override:
        counts = [int(c) for c in override.split(",")]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [list(range(a, a + c)) for a, c in zip(starts, counts)]
    costs, head = layer_costs(cfg)
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    worst = (float("inf"), float("inf"))
    # best[k][i]: (max cost, sum of squares) of putting layers i.. into stages k.. (>= 1 layer each)
    best = [[worst] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[n_stages][n] = (0.0, 0.0)
    for k in range(n_stages - 1, -1, -1):
        for i in range(n - 1, -1, -1):
            for j in range(i + 1, n - (n_stages - k - 1) + 1):
                stage = prefix[j] - prefix[i] + (head if k == n_stages - 1 else 0.0)
                if stage > best[k][i][0]:  # (costs >= 0: a later cut's stage is larger still, its max worse)
                    break
                rest = best[k + 1][j]
                value = (max(stage, rest[0]), stage * stage + rest[1])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    out, i = [], 0
    for k in range(n_stages):
        out.append(list(range(i, cut[k][i])))
        i = cut[k][i]
    return out


class _Key(tuple):
    """`model_key`'s tuple, its hash computed once: the caches that key on it hash it at every lookup."""

    def __hash__(self) -> int:
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h

    def __reduce__(self):  # (pickled as a plain tuple: string hashes differ between processes)
        return tuple, (tuple(self),)


# id(model) -> (a weak reference to it, its key): `model_key`'s keys, kept outside the models (frozen:
# a model's key never changes; dropped when the model dies, `_forget`)
MODEL_KEYS: dict[int, tuple] = {}


def model_key(m: ModelConfig) -> tuple:
    """A hashable form of a model config (the caches of the layout core and the planner key on it): its
    fields in their order, built once per model (a frozen dataclass; the planner asks for it ~10^5
    times a search)."""
    kept = MODEL_KEYS.get(id(m))
    if kept is not None and kept[0]() is m:  # (not a dead model's whose id was reused)
        return kept[1]
    key = _Key(vars(m).items())
    MODEL_KEYS[id(m)] = (weakref.ref(m, _forget(id(m))), key)
    return key


def _forget(model_id: int):
    """The callback that drops a dead model's key (unless its id already holds another model's)."""

    def forget(ref) -> None:
        kept = MODEL_KEYS.get(model_id)
        if kept is not None and kept[0] is ref:
            del MODEL_KEYS[model_id]

    return forget


@lru_cache(maxsize=64)
def model_of(key: tuple) -> ModelConfig:
    """The model config of a `model_key`, built once per key (the caches keyed on it ask on every miss;
    it is shared: read it, never change it)."""
    return ModelConfig(**dict(key))


@lru_cache(maxsize=4096)
def _split(key: tuple, n_stages: int, pp_layers: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s) for s in split_layers(model_of(key), n_stages, pp_layers))


def rank_chunks(m: ModelConfig, layout: Layout, pp_rank: int) -> list[Chunk]:
    """The (layers, first, last) chunks pipeline rank `pp_rank` holds, as the runtime places them."""
    return rank_chunks_by_key(
        model_key(m), layout.pp, placement(layout.pp_schedule), layout.n_stages, pp_rank, layout.pp_layers
    )


def rank_stages(layout: Layout, pp_rank: int) -> list[int]:
    """The pipeline stages pipeline rank `pp_rank` holds, in order."""
    return [s for s in range(layout.n_stages) if stage_rank(s, layout.pp, layout.pp_schedule) == pp_rank]


def placement(schedule: str) -> str:
    """Stages go to ranks in a loop or V-shaped: caches key on that, not on the schedule's name."""
    return "zbv" if schedule in V_SHAPED else "1f1b"


@lru_cache(maxsize=65536)
def rank_chunks_by_key(
    key: tuple, pp: int, schedule: str, n_stages: int, pp_rank: int, pp_layers: str = ""
) -> list[Chunk]:
    if pp == 1:
        return [(tuple(range(dict(key)["n_layers"])), True, True)]
    stages = _split(key, n_stages, pp_layers)
    return [(stages[s], s == 0, s == n_stages - 1) for s in range(n_stages) if stage_rank(s, pp, schedule) == pp_rank]
