"""The `flowgen` command line (installed as the top-level package `flowgen_cli`, which the `flowgen`
script runs, and as `flowgen.cli`); see `main.py`."""
