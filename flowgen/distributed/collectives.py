"""Collectives between ranks, carried by MPI (mpi4py; MPICH from PyPI: `pip install '.[dist]'`).

`world()` is the communicator of this process: `MpiWorld` when a launcher started several
processes, `SingleProcess` (no MPI loaded) otherwise, so world-size-1 code runs the same calls.
`group(ranks)` is the communicator of some ranks of the world, in the order given (a placement's
ranks: its collectives run among those ranks only, and `rank` is this process's index there):
`world()` for every rank in order, a `SingleProcess` for one rank (nothing to exchange), else an
MPI communicator made once per rank list (`MPI_Comm_create_group`, collective over those ranks only).
Tensors travel as NumPy arrays; a bucket of arrays of one dtype is packed into one flat buffer
so that it costs one MPI call (`all_reduce`).

The `all_reduce`, `reduce_scatter` and `all_gather` ops are the IR's view of the same thing:
`all_reduce` nodes (one per gradient bucket) come from `passes/gradient_allreduce.py` (others
from SyncBatchNorm's statistics and backward sums, nn/modules/normalization.py, and the norm of
ZeRO-2/3 gradient pieces clipped in build(), nn/utils.py),
`reduce_scatter` (ZeRO-2/3's gradient pieces) and `all_gather` (the parameter pieces ZeRO updated;
at stage 3 gathered before their readers) from `passes/zero.py`. They have no kernel (lowering
`Collective`): the executor runs them on the host between the kernels around them.

`send` and `recv` are point-to-point: a pipeline stage (flowgen/distributed/pipeline.py) sends
an activation or its gradient to the rank of the stage that reads it. A send never blocks (MPI
Isend of a host copy; `wait_sends()` after the step), a recv waits for its message, matched by
the sender's rank and the tag, so the ranks never wait on each other in a cycle.
"""
from __future__ import annotations

import numpy as np

from flowgen import dtype as dt
from flowgen.distributed import env
from flowgen.ops.lowering import Collective
from flowgen.ops.registry import TensorMeta, defop

REDUCE_OPS = ("sum", "mean")


class SingleProcess:
    """The world of a process started without a launcher: every collective is the identity."""

    rank, size = 0, 1

    def all_reduce(self, arrays: list, op: str = "sum") -> list:
        _check_op(op)
        return [np.array(a) for a in arrays]

    def all_gather(self, array: np.ndarray) -> list:
        return [np.array(array)]

    def all_gather_flat(self, arrays: list, sizes: list) -> list:
        return [np.array(a).ravel() for a in arrays]

    def reduce_scatter_flat(self, arrays: list, sizes: list, op: str = "sum") -> list:
        _check_op(op)
        return [np.array(a).ravel() for a in arrays]

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        return np.array(array)

    def send(self, array: np.ndarray, dest: int, tag: int):
        raise RuntimeError(f"send to rank {dest}: this process was started alone, there is no other rank")

    def recv(self, shape: tuple, dtype, source: int, tag: int) -> np.ndarray:
        raise RuntimeError(f"recv from rank {source}: this process was started alone, there is no other rank")

    def wait_sends(self):
        pass

    def barrier(self):
        pass


class MpiWorld:
    """MPI_COMM_WORLD, or (`comm`) a communicator of some of its ranks (`group`). mpi4py is
    imported here, not at module level: it is an optional dependency, and importing it initialises
    MPI, which only launched processes should do."""

    def __init__(self, comm=None):
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise RuntimeError(f"this process is rank {env.get_rank()} of {env.get_world_size()}, but mpi4py "
                               f"is not installed; install flowgen's 'dist' extra: pip install 'flowgen[dist]'"
                               ) from exc
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.pending_sends = []   # (request, host copy): the copy must live until the send completes
        if comm is None and (self.rank, self.size) != (env.get_rank(), env.get_world_size()):
            raise RuntimeError(f"MPI says rank {self.rank} of {self.size}, the environment says "
                               f"{env.get_rank()} of {env.get_world_size()}: launch with the mpiexec of the "
                               f"MPI that mpi4py was built against")

    def all_reduce(self, arrays: list, op: str = "sum") -> list:
        """Element-wise sum (or mean) over ranks of each array; one MPI call per dtype."""
        _check_op(op)
        out = [None] * len(arrays)
        for dtype in dict.fromkeys(np.asarray(a).dtype for a in arrays):
            members = [i for i, a in enumerate(arrays) if np.asarray(a).dtype == dtype]
            flat = np.concatenate([np.asarray(arrays[i]).ravel() for i in members])
            self.comm.Allreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)
            if op == "mean":
                flat = (flat / self.size).astype(dtype)
            offset = 0
            for i in members:
                shape = np.shape(arrays[i])
                out[i] = flat[offset:offset + int(np.prod(shape, dtype=np.int64))].reshape(shape)
                offset += out[i].size
        return out

    def all_gather(self, array: np.ndarray) -> list:
        """Every rank's array (shapes may differ), in rank order."""
        return self.comm.allgather(np.ascontiguousarray(array))

    def all_gather_flat(self, arrays: list, sizes: list) -> list:
        """Each array's pieces from all ranks, concatenated in rank order (`sizes[i]`: the
        element count rank r contributes to array i)."""
        out = []
        for piece, counts in zip(arrays, sizes):
            piece = np.ascontiguousarray(piece).ravel()
            whole = np.empty(sum(counts), piece.dtype)
            self.comm.Allgatherv(piece, [whole, list(counts)])
            out.append(whole)
        return out

    def reduce_scatter_flat(self, arrays: list, sizes: list, op: str = "sum") -> list:
        """This rank's piece of the sum (or mean) over ranks of each flattened array (`sizes[i]`:
        every rank's piece size of array i), in one MPI call per dtype: the send buffer holds rank
        0's pieces of all arrays, then rank 1's, ..."""
        _check_op(op)
        out = [None] * len(arrays)
        for dtype in dict.fromkeys(np.asarray(a).dtype for a in arrays):
            members = [i for i, a in enumerate(arrays) if np.asarray(a).dtype == dtype]
            flats = {i: np.asarray(arrays[i]).ravel() for i in members}
            starts = {i: np.cumsum([0, *sizes[i]]) for i in members}
            send = np.concatenate([flats[i][starts[i][r]:starts[i][r + 1]]
                                   for r in range(self.size) for i in members])
            counts = [sum(sizes[i][r] for i in members) for r in range(self.size)]
            mine = np.empty(counts[self.rank], dtype)
            self.comm.Reduce_scatter(send, mine, recvcounts=counts, op=self.MPI.SUM)
            if op == "mean":
                mine = (mine / self.size).astype(dtype)
            offset = 0
            for i in members:
                out[i] = mine[offset:offset + sizes[i][self.rank]]
                offset += sizes[i][self.rank]
        return out

    def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        data = np.array(array, order="C")     # a C-contiguous copy that keeps a 0-d array 0-d
        self.comm.Bcast(data, root=root)
        return data

    def send(self, array: np.ndarray, dest: int, tag: int):
        """Start sending a copy of `array` to rank `dest` and return at once (completed by `wait_sends`)."""
        data = np.ascontiguousarray(array).copy()
        self.pending_sends.append((self.comm.Isend(data, dest=dest, tag=tag), data))

    def recv(self, shape: tuple, dtype, source: int, tag: int) -> np.ndarray:
        """Wait for the array that rank `source` sent with `tag`."""
        data = np.empty(shape, dtype)
        self.comm.Recv(data, source=source, tag=tag)
        return data

    def wait_sends(self):
        """Wait until every send started so far has completed."""
        self.MPI.Request.Waitall([request for request, _ in self.pending_sends])
        self.pending_sends.clear()

    def barrier(self):
        self.comm.Barrier()


def _check_op(op: str):
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")


_world = None
_groups: dict = {}      # tuple of world ranks -> the communicator of those ranks


def world():
    """This process's communicator, created on first use."""
    global _world
    if _world is None:
        _world = MpiWorld() if env.get_world_size() > 1 else SingleProcess()
    return _world


def group(ranks) -> "MpiWorld | SingleProcess":
    """The communicator of the world ranks `ranks` (in that order: this process is `rank` = its
    index there). Only those ranks may call it, all together the first time (it is made then, a
    collective over them) and with the same list: a placement's ranks, or the union of two."""
    ranks = tuple(int(r) for r in ranks)
    comm = world()
    if ranks == tuple(range(comm.size)):
        return comm
    if comm.rank not in ranks:
        raise RuntimeError(f"rank {comm.rank} asked for the communicator of ranks {list(ranks)}, which it is not "
                           f"part of (a bug: please report it)")
    if ranks not in _groups:
        if len(ranks) == 1:
            _groups[ranks] = SingleProcess()
        else:
            members = comm.comm.group.Incl(list(ranks))
            _groups[ranks] = MpiWorld(comm.comm.Create_group(members))
            members.Free()
    return _groups[ranks]


# ------------------------------------------------------------------ the IR op
def _all_reduce_infer(*metas, op: str, world_size: int):
    _check_op(op)
    return tuple(TensorMeta(m.shape, m.dtype) for m in metas)


def _all_reduce_ref(*arrays, op: str, world_size: int):
    comm = world()
    if comm.size != world_size:
        raise RuntimeError(f"all_reduce: the graph was compiled for {world_size} ranks but this world has {comm.size}")
    out = comm.all_reduce(list(arrays), op)
    return tuple(out) if len(out) > 1 else out[0]


defop("all_reduce", infer=_all_reduce_infer, ref=_all_reduce_ref, lowering=Collective("all_reduce"),
      doc="all_reduce(*xs, op, world_size): each x summed (op='sum') or averaged (op='mean') over the ranks")


def _all_gather_infer(*metas, sizes, world_size: int, nth: int = 0):
    if len(sizes) != len(metas) or any(len(c) != world_size for c in sizes):
        raise ValueError(f"all_gather: sizes must give {world_size} piece sizes per input, got {sizes!r}")
    return tuple(TensorMeta((sum(c),), m.dtype) for m, c in zip(metas, sizes))


def _all_gather_ref(*arrays, sizes, world_size: int, nth: int = 0):
    comm = world()
    if comm.size != world_size:
        raise RuntimeError(f"all_gather: the graph was compiled for {world_size} ranks but this world has {comm.size}")
    out = comm.all_gather_flat(list(arrays), [list(c) for c in sizes])
    return tuple(out) if len(out) > 1 else out[0]


defop("all_gather", infer=_all_gather_infer, ref=_all_gather_ref, lowering=Collective("all_gather"),
      doc="all_gather(*pieces, sizes, world_size, nth=0): each input's pieces from all ranks, flat, in rank "
          "order; nth numbers repeated gathers of the same pieces in a step (ZeRO-3), which must stay apart")


def _reduce_scatter_infer(*metas, sizes, op: str, rank: int, world_size: int):
    _check_op(op)
    if len(sizes) != len(metas) or any(len(c) != world_size or sum(c) != int(np.prod(m.shape)) for m, c in zip(metas, sizes)):
        raise ValueError(f"reduce_scatter: sizes must split each input over {world_size} ranks, got {sizes!r}")
    return tuple(TensorMeta((c[rank],), m.dtype) for m, c in zip(metas, sizes))


def _reduce_scatter_ref(*arrays, sizes, op: str, rank: int, world_size: int):
    comm = world()
    if (comm.rank, comm.size) != (rank, world_size):
        raise RuntimeError(f"reduce_scatter: the graph was compiled for rank {rank} of {world_size}, "
                           f"this process is rank {comm.rank} of {comm.size}")
    out = comm.reduce_scatter_flat(list(arrays), [list(c) for c in sizes], op)
    return tuple(out) if len(out) > 1 else out[0]


defop("reduce_scatter", infer=_reduce_scatter_infer, ref=_reduce_scatter_ref, lowering=Collective("reduce_scatter"),
      doc="reduce_scatter(*xs, sizes, op, rank, world_size): this rank's piece of each x summed/averaged over ranks")


def _send_infer(meta, dest: int, tag: int):
    return TensorMeta((), dt.float32)


def _send_ref(array, dest: int, tag: int):
    world().send(array, dest, tag)
    return np.zeros((), np.float32)


defop("send", infer=_send_infer, ref=_send_ref, lowering=Collective("send"), side_effect=True,
      doc="send(x, dest, tag): x to rank dest without waiting; the 0-d result only keeps the send in the graph")


def _recv_infer(shape, dtype, source: int, tag: int):
    return TensorMeta(tuple(shape), dtype)


def _recv_ref(shape, dtype, source: int, tag: int):
    return world().recv(tuple(shape), dtype.np_dtype, source, tag)


defop("recv", infer=_recv_infer, ref=_recv_ref, lowering=Collective("recv"), side_effect=True,
      doc="recv(shape, dtype, source, tag): the tensor rank source sent with this tag (waits for it)")
