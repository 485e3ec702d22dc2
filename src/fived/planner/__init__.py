"""`fived plan`: which layout fits a model on a cluster and how fast it runs.

fived.layout.Layout (what is chosen) -> runtimes.py (what the runtime does with it) -> memory.py,
communication.py, timing.py (what it costs) -> search.py (enumerate, prune, rank) -> explain.py and
basis.py (what is printed, and what it rests on); hardware.py (the GPU catalogue, CPU ranks);
constants.py (timing.py's fitted constants as data: the calibration file calibration.json, with the
rows it was fitted on and its errors); published.py (published runs as planner inputs), fitting.py
(the fit that writes calibration.json) and calibration.py (`fived plan --validate`, in and out of
sample, per kind of run and per sweep of layouts).
"""
