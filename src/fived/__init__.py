"""fived: train Llama-style language models with composable 5D parallelism, verified against one device.

    from fived import Config, train, verify, plan

`Config` is the typed configuration (fived.config), `train`, `verify` and `plan` do what `fived
train`, `fived verify` and `fived plan` do, with keyword-only options (fived.api). Importing fived
imports no torch.
"""

from fived.api import TrainingFailed, plan, train, verify
from fived.config import Config, ConfigError
from fived.launch.run_summary import RunSummary
from fived.version import __version__

__all__ = ["Config", "ConfigError", "RunSummary", "TrainingFailed", "__version__", "plan", "train", "verify"]
