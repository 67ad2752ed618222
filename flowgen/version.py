"""flowgen's version, in a module of its own: saved graphs, manifests and the program cache record
it without importing the package root (which loads every layer)."""
__version__ = "0.1.0"
