"""Regional compilation: `train.compile = true` compiles each transformer block on its own (the way
torchtitan does), after every other dimension has swapped or wrapped its modules and after
activation checkpointing has wrapped the block, and before data parallelism shards it.

Compiling block by block rather than the whole model keeps compile time to one graph per distinct
block (the blocks share their code, so later ones reuse the first one's compiled code), keeps the
collectives between blocks (FSDP's gathers, pipeline sends) outside the graphs, and leaves the
embedding, the head and the loss eager. The compiled block wraps the original (`_orig_mod.` in
parameter names, which `fived.model.transformer.canonical_name` strips), so initialisation, checkpoints and
placements see the same names. `train.compile_backend` picks torch.compile's backend: "inductor"
(generated kernels; the default) or the cheaper "aot_eager" (traced, no code generation) and "eager".
"""

from __future__ import annotations

import torch
from torch import nn

from fived.model.transformer import Transformer


def apply_compile(model: Transformer, backend: str) -> None:
    """Replace every block of `model.layers` by its compiled wrapper."""
    for name, block in list(model.layers.named_children()):
        # dynamic=False: every micro-batch of a run has the same shape; one graph per block shape
        compiled = torch.compile(block, backend=backend, dynamic=False)
        assert isinstance(compiled, nn.Module)  # (torch.compile of a module is a module)
        model.layers.register_module(name, compiled)
