import os

# One BLAS thread: CI has 2 cores and the emulator already runs blocks on both.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402

os.environ.setdefault("FLOWGEN_CACHE", os.path.join(os.path.dirname(__file__), "..", ".flowgen-cache"))


def _gpu_available() -> bool:
    try:
        from flowgen.runtime import cuda_driver
    except ImportError:
        return False
    return cuda_driver.available()


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
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
