"""fived's version (its own module: anything may import it without importing the package's API)."""

__version__ = "0.1.0"
