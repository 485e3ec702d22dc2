import os

# One thread per rank; must be set before torch is imported (forked ranks inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
