"""`fived plan`: which layout fits a model on a cluster and how fast it runs.

fived.layout.Layout (what is chosen) -> runtimes.py (what the runtime does with it) -> memory.py,
communication.py, timing.py (what it costs) -> search.py (enumerate, prune, rank) -> explain.py and
basis.py (what is printed, and what it rests on); hardware.py (the GPU catalogue, CPU ranks);
published.py and calibration.py (the published runs that fit timing.py's constants, and
`fived plan --validate`, in and out of sample).
"""
