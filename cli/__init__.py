"""The `flowgen` command line, installed as the top-level package `flowgen_cli` (not under
`flowgen.`, whose __init__ loads NumPy and every op: `flowgen --help` loads only click); see
`main.py`."""
