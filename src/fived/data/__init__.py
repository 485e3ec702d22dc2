"""Data: tokenizers, token files and the global batch sampler (`loader`), `fived prepare-data` (`prepare`), and packed documents (`documents`)."""

# `fived prepare-data --format`: a token file with its .json sidecar, or Megatron-LM's .bin + .idx (here, in
# the package's numpy- and torch-free init: the command line's parser reads it)
OUTPUT_FORMATS = ("fived", "megatron")
