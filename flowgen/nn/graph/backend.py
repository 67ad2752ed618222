"""The backend a compiled graph's program runs on, and the GPU architecture it is rendered for."""
from __future__ import annotations

import os
import re

from flowgen.distributed.collectives import world
from flowgen.runtime.executor import CpuBackend, CudaBackend


def make_backend(device, source: str):
    if device.type == "cpu":
        return CpuBackend(source)
    # Imported here, not at the top: cuda-python's driver bindings take ~0.3 s to load and CPU graphs never use them.
    from flowgen.runtime import cuda_driver

    if not cuda_driver.available():
        if os.environ.get("FLOWGEN_EMULATE_CUDA") == "1":  # the CUDA program, run by the CPU emulator
            return CpuBackend(source)
        raise cuda_driver.NoCudaDevice("the graph's tensors are on 'cuda'")
    return CudaBackend(source)


def make_backend_once(device, source: str, data_parallel):
    """Ranks of a data-parallel graph compile the same source: rank 0 builds it into the
    cache while the others wait, then they load it from there."""
    if data_parallel is None or data_parallel.world_size == 1:
        return make_backend(device, source)
    comm = world()
    backend = make_backend(device, source) if comm.rank == 0 else None
    comm.barrier()
    return backend if backend is not None else make_backend(device, source)


def cuda_arch(device):
    """The GPU architecture a 'cuda' graph's program is rendered for (codegen/target.py): the
    GPU's; with no GPU under FLOWGEN_EMULATE_CUDA=1, FLOWGEN_EMULATE_CUDA_ARCH (e.g. sm_90, to run
    the Hopper kernels on the emulator), else None (any sm_80 or newer)."""
    if device.type != "cuda":
        return None
    # Imported here, not at the top: cuda-python's driver bindings take ~0.3 s to load and CPU graphs never use them.
    from flowgen.runtime import cuda_driver

    if cuda_driver.available():
        return cuda_driver.CudaContext.get().arch
    arch = os.environ.get("FLOWGEN_EMULATE_CUDA_ARCH") or None
    if arch is not None and not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"FLOWGEN_EMULATE_CUDA_ARCH={arch!r}: expected a GPU architecture such as sm_90")
    return arch
