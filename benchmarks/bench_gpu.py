"""One-GPU benchmark (issue 14): fived vs Hugging Face transformers' LlamaForCausalLM on a ~1B model
at seq 4096 in bf16, eager and compiled, and the ring's block path vs one SDPA call. Runs only on
CUDA; not written yet beyond this check, since no GPU was available to build and measure it on.

    python benchmarks/bench_gpu.py
"""
from __future__ import annotations

import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device on this machine; nothing measured (the GPU benchmark needs one)")
        return 0
    print("bench_gpu.py: a CUDA device is present, but the GPU measurements are not implemented yet")
    return 1


if __name__ == "__main__":
    sys.exit(main())
