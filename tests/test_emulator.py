"""The CPU emulator (runtime_cpp/flowgen_emu.h), one feature per test.

Every kernel below is plain CUDA C++: the same source is built for the emulator with g++ and
compiled by NVRTC for sm_80 and sm_90, which shows the emulator accepts real CUDA unchanged.
"""

import ctypes
import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from flowgen.runtime import cpu_compiler, nvrtc
from flowgen.runtime.cpu_compiler import CpuModule, build_cpu_library
from flowgen.runtime.toolchain import CompileError, cache_dir

SOURCE = r"""
// Every thread writes which block and thread it is; the grid overhangs the domain in x, y, z.
extern "C" __global__ void geometry(int* out, int nx, int ny, int nz) {
  unsigned x = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned y = blockIdx.y * blockDim.y + threadIdx.y;
  unsigned z = blockIdx.z * blockDim.z + threadIdx.z;
  if (x >= nx || y >= ny || z >= nz) return;
  int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  out[(z * ny + y) * nx + x] = block * 1000 + thread;
}
FLOWGEN_EMU_KERNEL(geometry, false)

extern "C" __global__ void reverse_blocks(const int* in, int* out) {
  __shared__ int tile[256];
  int base = blockIdx.x * blockDim.x;
  tile[threadIdx.x] = in[base + threadIdx.x];
  __syncthreads();
  out[base + threadIdx.x] = tile[blockDim.x - 1 - threadIdx.x];
}
FLOWGEN_EMU_KERNEL(reverse_blocks, true)

extern "C" __global__ void tree_sum(const float* in, float* out, int n) {
  __shared__ float partial[256];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  partial[threadIdx.x] = i < n ? in[i] : 0.0f;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}
FLOWGEN_EMU_KERNEL(tree_sum, true)

// Inclusive scan of each block in dynamic shared memory (blockDim.x ints).
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

// One column per shuffle variant; see SHUFFLES in the test for what each must equal.
extern "C" __global__ void shuffles(const int* in, int* out) {
  const unsigned all = 0xffffffffu;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int lane = threadIdx.x % 32;
  int v = in[i];
  int* row = out + i * 10;
  row[0] = __shfl_sync(all, v, (lane * 7 + 3) % 32);
  row[1] = __shfl_sync(all, v, 2, 8);
  row[2] = __shfl_xor_sync(all, v, 5);
  row[3] = __shfl_xor_sync(all, v, 3, 4);
  row[4] = __shfl_down_sync(all, v, 3);
  row[5] = __shfl_down_sync(all, v, 2, 16);
  row[6] = __shfl_up_sync(all, v, 4);
  row[7] = __shfl_xor_sync(all, v, 4, 4);
  row[8] = (int)(__shfl_xor_sync(all, (float)v * 0.5f, 16) * 2.0f);
  row[9] = (int)__shfl_up_sync(all, (unsigned)v, 1);
}
FLOWGEN_EMU_KERNEL(shuffles, true)

extern "C" __global__ void votes(const int* pred, unsigned* ballot, int* any, int* all) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  ballot[i] = __ballot_sync(0xffffffffu, pred[i]);
  any[i] = __any_sync(0xffffffffu, pred[i]);
  all[i] = __all_sync(0xffffffffu, pred[i]);
}
FLOWGEN_EMU_KERNEL(votes, true)

// Warp shuffles, shared memory, a barrier, a branch taken by warp 0 only, and an atomic.
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

extern "C" __global__ void histogram(const int* data, int n, unsigned* bins) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) atomicAdd(&bins[data[i]], 1u);
}
FLOWGEN_EMU_KERNEL(histogram, false)

// acc: int sum, float sum, u64 sum, max, min, CAS-loop counter, exchange slot.
extern "C" __global__ void atomics(const int* values, int n, int* acc, float* fsum,
                                   unsigned long long* usum, int* swapped_out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int v = values[i];
  atomicAdd(&acc[0], v);
  atomicAdd(fsum, (float)v);
  atomicAdd(usum, (unsigned long long)v << 32);
  atomicMax(&acc[1], v);
  atomicMin(&acc[2], v);
  int seen = acc[3], expected;
  do {
    expected = seen;
    seen = atomicCAS(&acc[3], expected, expected + 1);
  } while (seen != expected);
  swapped_out[i] = atomicExch(&acc[4], i);
}
FLOWGEN_EMU_KERNEL(atomics, false)

extern "C" __global__ void round_trip_16(const float* x, __half* h, float* h_back,
                                         __nv_bfloat16* b, float* b_back, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  h[i] = __float2half(x[i]);
  h_back[i] = __half2float(h[i]);
  b[i] = __float2bfloat16(x[i]);
  b_back[i] = __bfloat162float(b[i]);
}
FLOWGEN_EMU_KERNEL(round_trip_16, false)

extern "C" __global__ void arith_16(const __half* a, const __half* b, __half* h_out,
                                    const __nv_bfloat16* c, const __nv_bfloat16* d,
                                    __nv_bfloat16* b_out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  h_out[4 * i + 0] = a[i] + b[i];
  h_out[4 * i + 1] = a[i] - b[i];
  h_out[4 * i + 2] = a[i] * b[i];
  h_out[4 * i + 3] = a[i] / b[i];
  b_out[4 * i + 0] = c[i] + d[i];
  b_out[4 * i + 1] = c[i] - d[i];
  b_out[4 * i + 2] = c[i] * d[i];
  b_out[4 * i + 3] = c[i] / d[i];
}
FLOWGEN_EMU_KERNEL(arith_16, false)

// One column per function, in the order of MATH in the test.
extern "C" __global__ void math_fns(const float* x, const float* y, float* out, int* iout, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float a = __ldg(&x[i]), b = __ldg(&y[i]);
  float* r = out + i * 20;
  r[0] = expf(a);       r[1] = logf(a);          r[2] = sqrtf(a);       r[3] = rsqrtf(a);
  r[4] = tanhf(b);      r[5] = erff(b);          r[6] = fmaxf(a, b);    r[7] = fminf(a, b);
  r[8] = fabsf(b);      r[9] = powf(a, b);       r[10] = __expf(b);     r[11] = __logf(a);
  r[12] = __fdividef(a, b); r[13] = __frcp_rn(a); r[14] = fmaf(a, b, 1.0f); r[15] = floorf(b);
  r[16] = ceilf(b);     r[17] = max(a, b);       r[18] = min(a, b);     r[19] = sinf(b);
  iout[2 * i] = max((int)b, 1);
  iout[2 * i + 1] = min((int)b, -1);
}
FLOWGEN_EMU_KERNEL(math_fns, false)

// Uses a barrier but is registered without fibers: the emulator must refuse to run it.
extern "C" __global__ void misregistered(int* out) {
  __syncthreads();
  out[threadIdx.x] = 1;
}
FLOWGEN_EMU_KERNEL(misregistered, false)
"""


@pytest.fixture(scope="module")
def module():
    return CpuModule(build_cpu_library(SOURCE, "test_emulator"))


def ptr(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def blocks(n: int, size: int) -> tuple[int, int, int]:
    return ((n + size - 1) // size, 1, 1)


def test_grid_and_block_indexing_with_tails(module):
    nx, ny, nz = 21, 7, 5
    block, grid = (8, 4, 2), (3, 2, 3)
    out = np.full((nz, ny, nx), -1, np.int32)
    module.launch("geometry", grid, block, 0, [ptr(out), ctypes.c_int(nx), ctypes.c_int(ny), ctypes.c_int(nz)])
    z, y, x = np.meshgrid(np.arange(nz), np.arange(ny), np.arange(nx), indexing="ij")
    block_id = ((z // 2) * grid[1] + y // 4) * grid[0] + x // 8
    thread_id = ((z % 2) * 4 + y % 4) * 8 + x % 8
    np.testing.assert_array_equal(out, block_id * 1000 + thread_id)


def test_static_shared_memory_is_per_block(module):
    data = np.arange(64 * 256, dtype=np.int32)
    out = np.zeros_like(data)
    module.launch("reverse_blocks", (64, 1, 1), (256, 1, 1), 0, [ptr(data), ptr(out)])
    np.testing.assert_array_equal(out, data.reshape(64, 256)[:, ::-1].ravel())


def test_syncthreads_tree_reduction(module):
    n = 5000
    data = np.arange(n, dtype=np.float32) % 13
    out = np.zeros(20, np.float32)
    module.launch("tree_sum", blocks(n, 256), (256, 1, 1), 0, [ptr(data), ptr(out), ctypes.c_int(n)])
    expected = np.pad(data, (0, 20 * 256 - n)).reshape(20, 256).sum(axis=1)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("block", [64, 256])
def test_dynamic_shared_memory_sized_per_launch(module, block):
    data = np.random.default_rng(block).integers(-50, 50, 8 * block, dtype=np.int32)
    out = np.zeros_like(data)
    module.launch("block_scan", (8, 1, 1), (block, 1, 1), block * 4, [ptr(data), ptr(out)])
    np.testing.assert_array_equal(out, np.cumsum(data.reshape(8, block), axis=1).ravel())


def _lanes_from(source_lane):
    """Expected shuffle result per thread for two blocks of two warps: source_lane(lane)
    gives the lane read from, or None for "keeps its own value"."""
    values = np.arange(128, dtype=np.int32) * 3 + 1
    expected = values.copy()
    for i in range(128):
        src = source_lane(i % 32)
        if src is not None:
            expected[i] = values[i - i % 32 + src]
    return expected


SHUFFLES = {
    "shfl": lambda lane: (lane * 7 + 3) % 32,
    "shfl_width8": lambda lane: lane - lane % 8 + 2,
    "shfl_xor": lambda lane: lane ^ 5,
    "shfl_xor_width4": lambda lane: lane ^ 3,
    "shfl_down": lambda lane: lane + 3 if lane + 3 < 32 else None,
    "shfl_down_width16": lambda lane: lane + 2 if lane % 16 + 2 < 16 else None,
    "shfl_up": lambda lane: lane - 4 if lane >= 4 else None,
    # A lane may read an earlier width-group, never a later one.
    "shfl_xor_later_group": lambda lane: lane ^ 4 if lane & 4 else None,
    "shfl_xor_float": lambda lane: lane ^ 16,
    "shfl_up_unsigned": lambda lane: lane - 1 if lane >= 1 else None,
}


@pytest.mark.parametrize("column,variant", list(enumerate(SHUFFLES)))
def test_warp_shuffles(module, column, variant):
    values = np.arange(128, dtype=np.int32) * 3 + 1
    out = np.zeros((128, len(SHUFFLES)), np.int32)
    module.launch("shuffles", (2, 1, 1), (64, 1, 1), 0, [ptr(values), ptr(out)])
    np.testing.assert_array_equal(out[:, column], _lanes_from(SHUFFLES[variant]))


def test_ballot_any_all(module):
    pred = np.zeros(96, np.int32)
    pred[0:32] = 1  # warp 0: every lane votes yes
    pred[32:64:2] = 7  # warp 1: even lanes, any non-zero value counts
    ballot = np.zeros(96, np.uint32)
    any_, all_ = np.zeros(96, np.int32), np.zeros(96, np.int32)
    module.launch("votes", (1, 1, 1), (96, 1, 1), 0, [ptr(pred), ptr(ballot), ptr(any_), ptr(all_)])
    np.testing.assert_array_equal(ballot, np.repeat([0xFFFFFFFF, 0x55555555, 0], 32))
    np.testing.assert_array_equal(any_, np.repeat([1, 1, 0], 32))
    np.testing.assert_array_equal(all_, np.repeat([1, 0, 0], 32))


def test_warp_reduction_inside_a_branch_taken_by_one_warp(module):
    n = 100_000
    data = (np.arange(n) % 7).astype(np.float32)
    total = np.zeros(1, np.float32)
    module.launch("warp_sum", blocks(n, 256), (256, 1, 1), 0, [ptr(data), ptr(total), ctypes.c_int(n)])
    assert total[0] == data.sum()


def test_atomic_histogram_across_parallel_blocks(module):
    n = 1 << 18
    data = np.random.default_rng(1).integers(0, 16, n, dtype=np.int32)
    bins = np.zeros(16, np.uint32)
    module.launch("histogram", blocks(n, 128), (128, 1, 1), 0, [ptr(data), ctypes.c_int(n), ptr(bins)])
    np.testing.assert_array_equal(bins, np.bincount(data, minlength=16))


def test_atomic_add_max_min_cas_exchange(module):
    n = 1 << 16
    values = np.random.default_rng(2).integers(-1000, 1000, n, dtype=np.int32)
    values[123] = 5000
    acc = np.array([0, -(1 << 30), 1 << 30, 0, -1], np.int32)
    fsum, usum = np.zeros(1, np.float32), np.zeros(1, np.uint64)
    swapped_out = np.zeros(n, np.int32)
    module.launch(
        "atomics", blocks(n, 64), (64, 1, 1), 0,
        [ptr(values), ctypes.c_int(n), ptr(acc), ptr(fsum), ptr(usum), ptr(swapped_out)],
    )
    total = int(values.sum())
    assert acc[0] == total
    assert fsum[0] == total  # every partial sum is an integer below 2**24: exact
    assert int(usum[0]) == (total << 32) % (1 << 64)
    assert (acc[1], acc[2]) == (values.max(), values.min())
    assert acc[3] == n
    # Exchange hands the slot from thread to thread: the old values seen plus the final one
    # are the initial -1 and every thread id, each exactly once.
    seen = np.sort(np.append(swapped_out, acc[4]))
    np.testing.assert_array_equal(seen, np.arange(-1, n))


def _awkward_floats() -> np.ndarray:
    """Values that exercise rounding: ties, subnormals, overflow, specials, random bits."""
    special = [0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 1e6,
               2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-25 * 1.0001, 1e-30,
               1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.4e38]
    bits = np.random.default_rng(3).integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32)
    spread = np.random.default_rng(4).normal(0, 1, 20_000) * 10.0 ** np.random.default_rng(5).integers(-9, 6, 20_000)
    return np.concatenate([np.array(special, np.float32), bits.view(np.float32), spread.astype(np.float32)])


def _bits_match(actual: np.ndarray, expected: np.ndarray) -> None:
    a, e = actual.astype(np.float32), expected.astype(np.float32)
    nan = np.isnan(e)
    np.testing.assert_array_equal(np.isnan(a), nan)
    np.testing.assert_array_equal(actual.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])


def test_half_and_bfloat16_round_to_nearest_even(module):
    x = _awkward_floats()
    n = x.size
    h, b = np.zeros(n, np.float16), np.zeros(n, ml_dtypes.bfloat16)
    h_back, b_back = np.zeros(n, np.float32), np.zeros(n, np.float32)
    module.launch(
        "round_trip_16", blocks(n, 256), (256, 1, 1), 0,
        [ptr(x), ptr(h), ptr(h_back), ptr(b), ptr(b_back), ctypes.c_int(n)],
    )
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN inputs are intended
        _bits_match(h, x.astype(np.float16))
        _bits_match(b, x.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(h_back, h.astype(np.float32))
    np.testing.assert_array_equal(b_back, b.astype(np.float32))


def test_half_and_bfloat16_arithmetic_rounds_once(module):
    rng = np.random.default_rng(6)
    n = 4096
    a, b = (rng.normal(0, 100, n).astype(np.float16) for _ in range(2))
    c, d = (rng.normal(0, 100, n).astype(ml_dtypes.bfloat16) for _ in range(2))
    h_out, b_out = np.zeros((n, 4), np.float16), np.zeros((n, 4), ml_dtypes.bfloat16)
    module.launch(
        "arith_16", blocks(n, 256), (256, 1, 1), 0,
        [ptr(a), ptr(b), ptr(h_out), ptr(c), ptr(d), ptr(b_out), ctypes.c_int(n)],
    )

    def rounded(x, y, dtype):
        x, y = x.astype(np.float64), y.astype(np.float64)  # exact, then one rounding
        with np.errstate(all="ignore"):
            return np.stack([x + y, x - y, x * y, x / y], axis=1).astype(dtype)

    _bits_match(h_out, rounded(a, b, np.float16))
    _bits_match(b_out, rounded(c, d, ml_dtypes.bfloat16))


MATH = [
    lambda a, b: np.exp(a), lambda a, b: np.log(a), lambda a, b: np.sqrt(a),
    lambda a, b: 1 / np.sqrt(a), lambda a, b: np.tanh(b), lambda a, b: np.vectorize(math.erf)(b),
    np.fmax, np.fmin, lambda a, b: np.abs(b), np.power, lambda a, b: np.exp(b),
    lambda a, b: np.log(a), lambda a, b: a / b, lambda a, b: 1 / a, lambda a, b: a * b + 1,
    lambda a, b: np.floor(b), lambda a, b: np.ceil(b), np.maximum, np.minimum,
    lambda a, b: np.sin(b),
]


def test_math_intrinsics(module):
    rng = np.random.default_rng(7)
    n = 1000
    a = rng.uniform(0.1, 4.0, n).astype(np.float32)
    b = rng.uniform(-3.0, 3.0, n).astype(np.float32)
    out = np.zeros((n, len(MATH)), np.float32)
    iout = np.zeros((n, 2), np.int32)
    module.launch("math_fns", blocks(n, 128), (128, 1, 1), 0, [ptr(a), ptr(b), ptr(out), ptr(iout), ctypes.c_int(n)])
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for column, reference in enumerate(MATH):
        np.testing.assert_allclose(out[:, column], reference(a64, b64), rtol=2e-6, atol=1e-6,
                                   err_msg=f"column {column}")
    truncated = np.trunc(b).astype(np.int32)
    np.testing.assert_array_equal(iout[:, 0], np.maximum(truncated, 1))
    np.testing.assert_array_equal(iout[:, 1], np.minimum(truncated, -1))


def test_barrier_in_a_kernel_registered_without_fibers_aborts_with_a_message(module):
    # The abort kills the process, so the launch runs in a child interpreter.
    script = (
        "import ctypes, sys\n"
        "lib = ctypes.CDLL(sys.argv[1])\n"
        "out = ctypes.c_int(0); arg = ctypes.c_void_p(ctypes.addressof(out))\n"
        "dims = (ctypes.c_uint * 3)(1, 1, 1)\n"
        "params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))\n"
        "lib.flowgen_launch_misregistered(dims, dims, ctypes.c_size_t(0), params)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(module.path)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "__syncthreads" in result.stderr and "FLOWGEN_EMU_KERNEL(name, false)" in result.stderr


def test_missing_kernel_names_the_macro(module):
    with pytest.raises(KeyError, match="FLOWGEN_EMU_KERNEL"):
        module.launch("no_such_kernel", (1, 1, 1), (1, 1, 1), 0, [])


def test_arguments_must_be_ctypes_values(module):
    with pytest.raises(TypeError, match="ctypes values"):
        module.launch("geometry", (1, 1, 1), (1, 1, 1), 0, [np.zeros(1), 1, 2, 3])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_same_source_compiles_with_nvrtc(arch):
    cubin = nvrtc.compile_cuda(SOURCE, arch=arch, tag="test_emulator")
    assert cubin[:4] == b"\x7fELF"


def test_ptx_for_the_virtual_architecture():
    ptx = nvrtc.compile_ptx(SOURCE, arch="sm_80", tag="test_emulator")
    assert b".target sm_80" in ptx and b".entry warp_sum" in ptx


def test_cpu_build_is_cached_with_source_and_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEN_CACHE", str(tmp_path))
    source = 'extern "C" __global__ void one(int* p) { *p = 1; }\nFLOWGEN_EMU_KERNEL(one, false)\n'
    library = build_cpu_library(source, "cache test")
    assert library.parent.parent == cache_dir() / "cpu"
    assert (library.parent / "source.cu").read_text() == source
    assert (library.parent / "compile.log").is_file()

    def no_compiler(*args, **kwargs):
        raise AssertionError("g++ ran again for a cached source")

    monkeypatch.setattr(cpu_compiler.subprocess, "run", no_compiler)
    assert build_cpu_library(source, "cache test") == library
    value = np.zeros(1, np.int32)
    CpuModule(library).launch("one", (1, 1, 1), (1, 1, 1), 0, [ptr(value)])
    assert value[0] == 1


BROKEN = """extern "C" __global__ void broken(float* x) {
  int i = threadIdx.x;
  x[i] = undefined_name * 2.0f;
}
FLOWGEN_EMU_KERNEL(broken, false)
"""


def test_gxx_errors_show_the_offending_source_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEN_CACHE", str(tmp_path))
    with pytest.raises(CompileError) as caught:
        build_cpu_library(BROKEN, "broken")
    message = str(caught.value)
    assert "undefined_name" in message and "was not declared" in message
    assert ">> 3 |   x[i] = undefined_name * 2.0f;" in message
    assert "   2 |   int i = threadIdx.x;" in message
    assert str(caught.value.source_path) in message and caught.value.source_path.name == "source.cu"


def test_nvrtc_errors_show_the_offending_source_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEN_CACHE", str(tmp_path))
    with pytest.raises(CompileError) as caught:
        nvrtc.compile_cuda(BROKEN, arch="sm_90", tag="broken")
    message = str(caught.value)
    # The prelude include is prepended, so the bad line is line 4 of kernels.cu.
    assert 'identifier "undefined_name" is undefined' in message
    assert ">> 4 |   x[i] = undefined_name * 2.0f;" in message
    assert (caught.value.source_path.parent / "compile.log").read_text() == caught.value.log


def test_nvrtc_build_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEN_CACHE", str(tmp_path))
    source = 'extern "C" __global__ void one(int* p) { *p = 1; }\n'
    cubin = nvrtc.compile_cuda(source, arch="sm_90", tag="cached")
    (build_dir,) = (tmp_path / "nvrtc").iterdir()
    assert sorted(p.name for p in build_dir.iterdir()) == ["compile.log", "kernels.cu", "kernels.cubin"]
    monkeypatch.setattr(nvrtc.nvrtc, "nvrtcCompileProgram", None)  # any compile would now fail
    assert nvrtc.compile_cuda(source, arch="sm_90", tag="cached") == cubin


def test_nvrtc_never_writes_into_shared_bytes_objects(tmp_path, monkeypatch):
    """Regression: an empty compile log (size 1) was read into b" " * 1, CPython's shared
    one-byte object, so NVRTC's NUL turned every later b" " into b"\\0"."""
    from flowgen.runtime import nvrtc

    monkeypatch.setenv("FLOWGEN_CACHE", str(tmp_path))   # a real compile, not a cache hit
    nvrtc.compile_cuda('extern "C" __global__ void k_clean(float* x) { x[0] = 1.0f; }\n'
                       "FLOWGEN_EMU_KERNEL(k_clean, false)\n", "sm_80", tag="shared-bytes-check")
    assert b" " * 3 == b"   " and bytes([32]) == b" "
