"""fived: train Llama-style language models with composable 5D parallelism, verified against one device.

    from fived import Config, train, verify, plan

`Config` is the typed configuration (fived.config), `train`, `verify` and `plan` do what `fived
train`, `fived verify` and `fived plan` do, with keyword-only options (fived.api). Importing fived
imports no torch.
"""

import os

# CPU ranks are forked from the launcher (fived.launch.ranks). torch.cuda.is_available() answers by
# initialising CUDA's driver unless this is set, and a rank forked after that fails at its first CUDA
# call (torch 2.11's optimizers ask the accelerator whether it is capturing a graph: seen on an H200,
# docs/gpu.md); NVML answers without initialising anything. A user's own setting stands.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from fived.api import TrainingFailed, plan, train, verify
from fived.config import Config, ConfigError
from fived.launch.run_summary import RunSummary
from fived.version import __version__

__all__ = ["Config", "ConfigError", "RunSummary", "TrainingFailed", "__version__", "plan", "train", "verify"]
