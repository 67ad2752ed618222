import os
import sys

# One BLAS thread: CI has 2 cores and the emulator already runs blocks on both.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLOWGEN_CACHE", os.path.join(ROOT, ".flowgen-cache"))
# The suite checks the CUDA source: 'cpu' graphs run every kernel on the emulator. The cpu target's
# native kernels (GEMMs and convs through OpenBLAS) have their own tests (test_cpu_fast_path.py).
os.environ.setdefault("FLOWGEN_CPU_KERNELS", "emulator")
# The tensor-core kernel cases the tests share with the first-contact GPU run
# (benchmarks/first_contact_cases.py); appended, so no benchmark script shadows a test module.
sys.path.append(os.path.join(ROOT, "benchmarks"))

from first_contact_cases import gpu_arch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if gpu_arch() is not None:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and driver; none found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    import flowgen

    if hasattr(flowgen, "manual_seed"):
        flowgen.manual_seed(0)


# Where a tensor-core test runs its kernels: each such test runs once on the CPU emulator and,
# marked `gpu` (pytest -m gpu), once on the GPU when one is present.
TARGETS = [pytest.param("emulator", id="emulator"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def _gpu_arch_or_skip(minimum: int, exact: str = None) -> str:
    arch = gpu_arch()
    if exact is not None and arch != exact:
        pytest.skip(f"needs an {exact} GPU; this one is {arch}")
    if int(arch[3:].rstrip("a")) < minimum:
        pytest.skip(f"needs an sm_{minimum} GPU or newer; this one is {arch}")
    return arch


@pytest.fixture(scope="module", params=TARGETS)
def kernel_target(request) -> str:
    """"emulator" or "gpu" (an sm_80 or newer: mma.sync, ldmatrix, cp.async) for kernels launched
    through first_contact_cases.make_launch."""
    if request.param == "gpu":
        _gpu_arch_or_skip(80)
    return request.param


@pytest.fixture(scope="module", params=TARGETS)
def sm90_kernel_target(request) -> str:
    """"emulator" or "gpu" (an sm_90: warpgroup MMA) for kernels rendered for sm_90."""
    if request.param == "gpu":
        _gpu_arch_or_skip(90, exact="sm_90")
    return request.param


def _graph_target(request, monkeypatch, arch=None) -> str:
    """'cuda' graphs run on the GPU ("gpu") or, with no GPU, on the emulator (FLOWGEN_EMULATE_CUDA=1,
    rendered for `arch`: FLOWGEN_EMULATE_CUDA_ARCH); with a GPU present the emulator variant is
    skipped (a GPU always runs 'cuda' graphs itself: the gpu variant covers them)."""
    if request.param == "gpu":
        _gpu_arch_or_skip(80, exact=arch)
        return "gpu"
    if gpu_arch() is not None:
        pytest.skip("a GPU is present: 'cuda' graphs run on it (the gpu variant)")
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    if arch is None:
        monkeypatch.delenv("FLOWGEN_EMULATE_CUDA_ARCH", raising=False)
    else:
        monkeypatch.setenv("FLOWGEN_EMULATE_CUDA_ARCH", arch)
    return "emulator"


@pytest.fixture(params=TARGETS)
def cuda_graph_target(request, monkeypatch) -> str:
    """Where 'cuda' graphs run: "gpu" or "emulator" (rendered for any sm_80 or newer)."""
    return _graph_target(request, monkeypatch)


@pytest.fixture(params=TARGETS)
def sm90_graph_target(request, monkeypatch) -> str:
    """Where 'cuda' graphs rendered for sm_90 (warpgroup MMA) run: an sm_90 GPU, or the emulator."""
    return _graph_target(request, monkeypatch, arch="sm_90")


@pytest.fixture(params=[pytest.param("cpu", id="cpu"), pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)])
def graph_device(request) -> str:
    """The device of a public-API graph test: "cpu" (the cpu target, on the emulator) or, marked
    `gpu`, "cuda" on the GPU (rendered for its architecture)."""
    if request.param == "cuda":
        _gpu_arch_or_skip(80)
    return request.param
