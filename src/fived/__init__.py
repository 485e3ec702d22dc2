"""fived: train Llama-style language models with composable 5D parallelism, verified against one device."""
from fived.version import __version__

__all__ = ["__version__"]
