"""One rank's training loop (`trainer`), its state for checkpoints, optimizers and lr, Muon, the divergence guard, faults, metrics, the step breakdown and `fived verify`.

(Named `training`, not `train`: `fived.train` is the Python API's function.)"""
