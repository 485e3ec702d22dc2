"""Optimizers: AdamW with its lr schedule, and Muon (orthogonalised momentum) with its sharded step."""
