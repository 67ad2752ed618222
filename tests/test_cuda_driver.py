"""The CUDA driver wrapper: a clear error without a GPU, and real launches with one.

The GPU tests also run the same kernels on the CPU emulator and require identical results,
which checks the emulator's semantics (shuffles, votes, 16-bit rounding) against hardware.
"""

import ctypes

import numpy as np
import pytest

from flowgen.runtime import cuda_driver, nvrtc
from flowgen.runtime.cpu_compiler import CpuModule, build_cpu_library
from flowgen.runtime.cuda_driver import CudaContext, CudaError, CudaModule, NoCudaDevice

HAVE_GPU = cuda_driver.available()
requires_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU and driver")
requires_no_gpu = pytest.mark.skipif(HAVE_GPU, reason="a CUDA GPU is present")

SOURCE = r"""
extern "C" __global__ void saxpy(float a, const float* __restrict__ x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
FLOWGEN_EMU_KERNEL(saxpy, false)

extern "C" __global__ void add_scalar(float* x, float s, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += s;
}
FLOWGEN_EMU_KERNEL(add_scalar, false)

extern "C" __global__ void block_scan(const int* in, int* out) {
  FLOWGEN_DYN_SHARED(int, buf);
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  buf[threadIdx.x] = in[i];
  __syncthreads();
  for (int offset = 1; offset < blockDim.x; offset *= 2) {
    int add = threadIdx.x >= offset ? buf[threadIdx.x - offset] : 0;
    __syncthreads();
    buf[threadIdx.x] += add;
    __syncthreads();
  }
  out[i] = buf[threadIdx.x];
}
FLOWGEN_EMU_KERNEL(block_scan, true)

extern "C" __global__ void warp_ops(const int* in, int* out) {
  const unsigned all = 0xffffffffu;
  int i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
  int v = in[i];
  int* row = out + i * 9;
  row[0] = __shfl_sync(all, v, (lane * 7 + 3) % 32);
  row[1] = __shfl_sync(all, v, 2, 8);
  row[2] = __shfl_xor_sync(all, v, 4, 4);
  row[3] = __shfl_down_sync(all, v, 3);
  row[4] = __shfl_down_sync(all, v, 2, 16);
  row[5] = __shfl_up_sync(all, v, 5, 8);
  row[6] = (int)__ballot_sync(all, v % 3 == 0);
  row[7] = __any_sync(all, v > 200);
  row[8] = __all_sync(all, v > 0);
}
FLOWGEN_EMU_KERNEL(warp_ops, true)

extern "C" __global__ void warp_sum(const float* in, float* total, int n) {
  __shared__ float per_warp[32];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float v = i < n ? in[i] : 0.0f;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (lane == 0) per_warp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? per_warp[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0) atomicAdd(total, v);
  }
}
FLOWGEN_EMU_KERNEL(warp_sum, true)

extern "C" __global__ void to_16bit(const float* x, __half* h, __nv_bfloat16* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    h[i] = __float2half(x[i]) * __float2half(3.0f);
    b[i] = __float2bfloat16(x[i]) + __float2bfloat16(1.0f);
  }
}
FLOWGEN_EMU_KERNEL(to_16bit, false)
"""


@requires_no_gpu
def test_available_is_false_without_a_gpu():
    assert cuda_driver.available() is False


@requires_no_gpu
def test_context_without_a_gpu_points_to_the_cpu_emulator():
    with pytest.raises(NoCudaDevice, match='device="cpu"'):
        CudaContext.get()


@pytest.fixture(scope="module")
def ctx():
    return CudaContext.get()


@pytest.fixture(scope="module")
def gpu_module(ctx):
    module = CudaModule(nvrtc.compile_cuda(SOURCE, arch=ctx.arch, tag="test_cuda_driver"))
    yield module
    module.close()


@pytest.fixture(scope="module")
def cpu_module():
    return CpuModule(build_cpu_library(SOURCE, "test_cuda_driver"))


class Device:
    """Device copies of host arrays, freed when the test ends."""

    def __init__(self, ctx: CudaContext):
        self.ctx = ctx
        self.buffers: list[int] = []

    def put(self, array: np.ndarray) -> ctypes.c_void_p:
        dptr = self.ctx.alloc(array.nbytes)
        self.buffers.append(dptr)
        self.ctx.memcpy_htod(dptr, array)
        return ctypes.c_void_p(dptr)

    def get(self, like: np.ndarray, dptr: ctypes.c_void_p) -> np.ndarray:
        out = np.empty_like(like)
        self.ctx.memcpy_dtoh(out, dptr.value)
        return out


@pytest.fixture
def dev(ctx):
    device = Device(ctx)
    yield device
    ctx.synchronize()
    for dptr in device.buffers:
        ctx.free(dptr)


def ptr(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


@pytest.mark.gpu
@requires_gpu
def test_context_reports_the_device_architecture(ctx):
    major, minor = ctx.compute_capability()
    assert major >= 7 and ctx.arch == f"sm_{major}{minor}"
    assert CudaContext.get() is ctx


@pytest.mark.gpu
@requires_gpu
def test_saxpy_with_a_partial_last_block(gpu_module, dev):
    n = 1_000_003
    x = np.random.default_rng(0).normal(size=n).astype(np.float32)
    y = np.random.default_rng(1).normal(size=n).astype(np.float32)
    dx, dy = dev.put(x), dev.put(y)
    gpu_module.launch("saxpy", ((n + 255) // 256, 1, 1), (256, 1, 1), 0,
                      [ctypes.c_float(2.5), dx, dy, ctypes.c_int(n)])
    # The GPU fuses a * x + y into one rounding; compare against the exact value.
    exact = 2.5 * x.astype(np.float64) + y
    np.testing.assert_allclose(dev.get(y, dy), exact, rtol=2.0**-23)


@pytest.mark.gpu
@requires_gpu
def test_memset_and_copies(ctx, dev):
    data = np.arange(1000, dtype=np.int32)
    dptr = dev.put(data)
    np.testing.assert_array_equal(dev.get(data, dptr), data)
    ctx.memset(dptr.value, 0xFF, data.nbytes)
    np.testing.assert_array_equal(dev.get(data, dptr), np.full(1000, -1, np.int32))


@pytest.mark.gpu
@requires_gpu
def test_warp_intrinsics_match_the_emulator(gpu_module, cpu_module, dev):
    values = np.arange(1, 257, dtype=np.int32) * 5 % 251
    out = np.zeros((256, 9), np.int32)
    d_in, d_out = dev.put(values), dev.put(out)
    gpu_module.launch("warp_ops", (2, 1, 1), (128, 1, 1), 0, [d_in, d_out])
    cpu_module.launch("warp_ops", (2, 1, 1), (128, 1, 1), 0, [ptr(values), ptr(out)])
    np.testing.assert_array_equal(dev.get(out, d_out), out)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("block,smem", [(256, 256 * 4), (1024, 64 * 1024)])
def test_dynamic_shared_memory_matches_the_emulator(gpu_module, cpu_module, dev, block, smem):
    # 64 KiB is above the default 48 KiB limit: the launch must opt the kernel in.
    data = np.random.default_rng(2).integers(-100, 100, 4 * block, dtype=np.int32)
    out = np.zeros_like(data)
    d_in, d_out = dev.put(data), dev.put(out)
    gpu_module.launch("block_scan", (4, 1, 1), (block, 1, 1), smem, [d_in, d_out])
    cpu_module.launch("block_scan", (4, 1, 1), (block, 1, 1), smem, [ptr(data), ptr(out)])
    np.testing.assert_array_equal(out, np.cumsum(data.reshape(4, block), axis=1).ravel())
    np.testing.assert_array_equal(dev.get(out, d_out), out)


@pytest.mark.gpu
@requires_gpu
def test_block_reduction_with_atomics(gpu_module, dev):
    n = 300_000
    data = (np.arange(n) % 11).astype(np.float32)
    total = np.zeros(1, np.float32)
    d_data, d_total = dev.put(data), dev.put(total)
    gpu_module.launch("warp_sum", ((n + 255) // 256, 1, 1), (256, 1, 1), 0,
                      [d_data, d_total, ctypes.c_int(n)])
    assert dev.get(total, d_total)[0] == data.sum()  # integer partial sums: exact in any order


@pytest.mark.gpu
@requires_gpu
def test_16bit_rounding_matches_the_emulator(gpu_module, cpu_module, dev):
    bits = np.random.default_rng(3).integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([bits.view(np.float32), np.float32([65519.0, 65520.0, 2.0**-25, 1e-8])])
    x = x[np.isfinite(x)]
    n = x.size
    h, b = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    d_x, d_h, d_b = dev.put(x), dev.put(h), dev.put(b)
    gpu_module.launch("to_16bit", ((n + 255) // 256, 1, 1), (256, 1, 1), 0, [d_x, d_h, d_b, ctypes.c_int(n)])
    cpu_module.launch("to_16bit", ((n + 255) // 256, 1, 1), (256, 1, 1), 0, [ptr(x), ptr(h), ptr(b), ctypes.c_int(n)])
    np.testing.assert_array_equal(dev.get(h, d_h), h)
    np.testing.assert_array_equal(dev.get(b, d_b), b)


@pytest.mark.gpu
@requires_gpu
def test_graph_capture_and_replay(ctx, gpu_module, dev, monkeypatch):
    # Debug sync must not synchronise a stream that is being captured.
    monkeypatch.setenv("FLOWGEN_DEBUG_SYNC", "1")
    n = 1000
    x = np.zeros(n, np.float32)
    d_x = dev.put(x)
    stream = ctx.create_stream()
    try:
        ctx.begin_capture(stream)
        for step in (1.0, 2.0):
            gpu_module.launch("add_scalar", (4, 1, 1), (256, 1, 1), 0,
                              [d_x, ctypes.c_float(step), ctypes.c_int(n)], stream=stream)
        graph = ctx.end_capture(stream)
        ctx.synchronize(stream)
        np.testing.assert_array_equal(dev.get(x, d_x), x)  # capturing ran nothing
        for _ in range(3):
            ctx.launch_graph(graph, stream)
        ctx.synchronize(stream)
        np.testing.assert_array_equal(dev.get(x, d_x), np.full(n, 9.0, np.float32))
        ctx.destroy_graph(graph)
    finally:
        ctx.destroy_stream(stream)


@pytest.mark.gpu
@requires_gpu
def test_launch_errors_name_the_kernel(gpu_module, dev, monkeypatch):
    monkeypatch.setenv("FLOWGEN_DEBUG_SYNC", "1")
    x = np.zeros(4, np.float32)
    d_x = dev.put(x)
    with pytest.raises(CudaError, match="fused_step_3"):  # more threads per block than allowed
        gpu_module.launch("add_scalar", (1, 1, 1), (4096, 1, 1), 0,
                          [d_x, ctypes.c_float(1.0), ctypes.c_int(4)], name_for_errors="fused_step_3")
    with pytest.raises(CudaError, match="cuModuleGetFunction"):
        gpu_module.function("no_such_kernel")


@pytest.mark.gpu
@requires_gpu
def test_ptx_is_compiled_by_the_driver(ctx, dev):
    if ctx.driver_version() < nvrtc.nvrtc_version():
        pytest.skip("the driver is older than NVRTC and cannot JIT its PTX")
    module = CudaModule(nvrtc.compile_ptx(SOURCE, arch=ctx.arch, tag="test_cuda_driver"))
    try:
        x = np.ones(100, np.float32)
        d_x = dev.put(x)
        module.launch("add_scalar", (1, 1, 1), (128, 1, 1), 0, [d_x, ctypes.c_float(0.5), ctypes.c_int(100)])
        np.testing.assert_array_equal(dev.get(x, d_x), np.full(100, 1.5, np.float32))
    finally:
        module.close()
