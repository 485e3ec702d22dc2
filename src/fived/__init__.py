"""fived: train Llama-style language models with composable 5D parallelism, verified against one device."""
__version__ = "0.1.0"
