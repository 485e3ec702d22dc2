import os

# One thread per rank; must be set before torch is imported (forked ranks inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)

from fived.tools import verification  # noqa: E402  (after the thread count: it imports the trainer)

# One single-process reference per configuration for the whole session: the verifications share them.
verification.REFERENCE_CACHE = {}
