"""`python -m flowgen.distributed.launch --nproc_per_node N script.py [args]`: start N ranks.

The ranks are started by MPI's `mpiexec` (MPICH's Hydra from the `mpich` wheel, or any on
PATH; `--mpiexec` picks another), which also gives each its rank (flowgen/distributed/env.py).
Running `mpiexec -n N python script.py` directly is equivalent. One machine only: for several,
run the MPI launcher with a host file (see docs/distributed.md, "Beyond one machine").
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys


def mpiexec_command(nproc: int, script: str, script_args: list, mpiexec: str | None = None) -> list:
    launcher = mpiexec or shutil.which("mpiexec")
    if launcher is None:
        raise SystemExit("flowgen.distributed.launch: no mpiexec on PATH; install flowgen's 'dist' extra "
                         "(pip install 'flowgen[dist]': mpi4py + the mpich wheel) or pass --mpiexec")
    return [launcher, "-n", str(nproc), sys.executable, script, *script_args]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flowgen.distributed.launch",
                                     description="Start one process per rank with mpiexec.")
    parser.add_argument("--nproc_per_node", type=int, default=1, help="ranks to start on this machine")
    parser.add_argument("--nnodes", type=int, default=1, help="machines (flowgen's launcher: 1)")
    parser.add_argument("--mpiexec", default=None, help="the MPI launcher to run (default: mpiexec on PATH)")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nproc_per_node < 1:
        parser.error(f"--nproc_per_node must be at least 1, got {args.nproc_per_node}")
    if args.nnodes != 1:
        parser.error(f"--nnodes {args.nnodes}: this launcher starts ranks on one machine; for several, run "
                     f"mpiexec with a host file (mpiexec -f hosts -n N python script.py)")
    command = mpiexec_command(args.nproc_per_node, args.script, args.script_args, args.mpiexec)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
