"""Data: tokenizers, token files and the global batch sampler (`loader`), `fived prepare-data` (`prepare`), and packed documents (`documents`)."""
