"""The model without parallel branches: the transformer, attention kernels, grouped experts, and initialisation by placement."""
