"""`fived plan`: which layout fits a model on a cluster and how fast it runs.

fived.mesh.Layout (what is chosen) -> memory.py, timing.py (what it costs) -> search.py (enumerate, prune,
rank) -> explain.py (what is printed); hardware.py (the GPU catalogue); calibration.py (the
published runs that fit timing.py's constants, and `fived plan --validate`).
"""
