"""`flow.env`: which rank this process is, read from the launcher's environment.

`mpiexec` (MPICH's Hydra, which `python -m flowgen.distributed.launch` runs) tells each process
its place in `PMI_RANK` / `PMI_SIZE` / `MPI_LOCALRANKID`; Open MPI's spellings and OneFlow's
own (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`) are read too. A process started without a launcher is
rank 0 of 1, and never loads MPI.
"""
from __future__ import annotations

import os

_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK")
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE")
_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK")
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")


def _first(names, default: int) -> int:
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return default


def get_rank() -> int:
    """This process's rank in [0, world size)."""
    return _first(_RANK_VARS, 0)


def get_world_size() -> int:
    """How many processes the launcher started (1 without a launcher)."""
    return _first(_SIZE_VARS, 1)


def get_local_rank() -> int:
    """This process's rank among the processes on its machine."""
    return _first(_LOCAL_RANK_VARS, 0)


def get_node_size() -> int:
    """How many machines take part: world size over processes per machine."""
    return max(1, get_world_size() // _first(_LOCAL_SIZE_VARS, get_world_size()))

