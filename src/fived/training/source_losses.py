"""A blend's per-source figures of each step: `tokens_by_source` and `loss_by_source`.

Which source each row of the global batch came from is known on every rank from the sampler (a
function of the step alone), so the token counts need no communication. The losses are each row's
summed token cross-entropy, added up by source on each rank and reduced with the step's loss (the
same all-reduce, a few more float64 values): exact whatever the layout.
"""

from __future__ import annotations

import numpy as np
import torch


class SourceLosses:
    """Collects the rows' losses of one step (in the order the micro-batches are computed)."""

    def __init__(self, sources: tuple[str, ...]):
        self.sources = sources  # a blend's paths as given; () without a blend: nothing is collected
        self.rows: list[torch.Tensor] = []

    def start(self) -> None:
        self.rows.clear()

    def loss_sum(self, plan, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed token cross-entropy of a micro-batch (plan.loss_sum's), its rows' sums kept."""
        if not self.sources:
            return plan.loss_sum(logits, targets)
        tokens = plan.token_losses(logits, targets)
        self.rows.append(tokens.detach().double().sum(dim=1))
        return tokens.sum()

    def sums(self, local_sources: np.ndarray, microbatches: int, device: torch.device) -> torch.Tensor:
        """float64 [sources]: this rank's summed loss per source. A pipeline's last stage computed
        the step's `microbatches` losses last (its first step may run a shape-inference pass first);
        other stages computed none (zeros, as their share of the step's loss)."""
        out = torch.zeros(len(self.sources), dtype=torch.float64, device=device)
        if not self.sources or not self.rows:
            return out
        rows = torch.cat(self.rows[-microbatches:])
        assert len(rows) == len(local_sources), (len(rows), len(local_sources))
        return out.index_add_(0, torch.as_tensor(local_sources, device=device), rows)

    def record(self, sums: torch.Tensor, global_sources: np.ndarray, seq_len: int) -> dict:
        """The step record's entries: tokens and mean token loss per source (None: none this step)."""
        if not self.sources:
            return {}
        counts = np.bincount(global_sources, minlength=len(self.sources)) * seq_len
        values = sums.tolist()
        return {
            "tokens_by_source": {name: int(n) for name, n in zip(self.sources, counts)},
            "loss_by_source": {name: (v / int(n) if n else None) for name, n, v in zip(self.sources, counts, values)},
        }
