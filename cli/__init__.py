"""The `flowgen` command line (installed as the package `flowgen.cli`); see `main.py`."""
