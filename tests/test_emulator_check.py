"""The checking emulator (FLOWGEN_EMULATOR_CHECK=1, runtime_cpp/flowgen_emu_check.h): a launch that
breaks a rule of the hardware fails with EmulatorCheckError, naming the kernel, the block, the
thread and the address, where compute-sanitizer (racecheck, synccheck, memcheck) or the GPU itself
would have complained.

One hand-written CUDA kernel per hazard, built like every emulator kernel (build_cpu_library,
CpuModule) and compiled by NVRTC as it stands; then the generated kernels of every family that synchronises (tensor-core GEMM and
implicit-GEMM conv on mma.sync and on wgmma, tiled attention forward and backward, reductions,
fused elementwise kernels) in two bf16 training steps through the public API, which must run clean.
"""
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.runtime import cpu_compiler, cuda_driver, nvrtc
from flowgen.runtime.cpu_compiler import CpuModule, EmulatorCheckError, build_cpu_library
from flowgen.runtime.toolchain import CompileError
from graphs import TrainGraph

TOO_MUCH_STATIC_SHARED = r"""
// More static shared memory than a kernel may declare (48 KB).
extern "C" __global__ void too_much_static_shared(int* out) {
  __shared__ float big[12 * 1024 + 1];
  big[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = int(big[threadIdx.x]);
}
FLOWGEN_EMU_KERNEL(too_much_static_shared, true)
"""

HAZARDS = TOO_MUCH_STATIC_SHARED + r"""
// Each thread publishes its value, then reads its left neighbour's with no barrier between.
extern "C" __global__ void read_after_write(const int* in, int* out) {
  __shared__ int slots[64];
  const int t = threadIdx.x;
  slots[t] = in[t];
  out[t] = slots[(t + 63) % 64];
}
FLOWGEN_EMU_KERNEL(read_after_write, true)

// Each thread reads its right neighbour's slot, then overwrites its own: no barrier between the
// neighbour's read and the write.
extern "C" __global__ void write_after_read(int* out) {
  __shared__ int slots[64];
  const int t = threadIdx.x;
  slots[t] = t;
  __syncthreads();
  out[t] = slots[(t + 1) % 64];
  slots[t] = -t;
}
FLOWGEN_EMU_KERNEL(write_after_read, true)

// Threads 2i and 2i + 1 both write slot i.
extern "C" __global__ void write_after_write(int* out) {
  __shared__ int slots[32];
  const int t = threadIdx.x;
  slots[t / 2] = t;
  __syncthreads();
  out[t] = slots[t / 2];
}
FLOWGEN_EMU_KERNEL(write_after_write, true)

// Lanes exchange through shared memory across a __syncwarp, which orders them: correct.
extern "C" __global__ void warp_ordered(int* out) {
  __shared__ int slots[64];
  const int t = threadIdx.x;
  slots[t] = t;
  __syncwarp();
  out[t] = slots[t ^ 1];
}
FLOWGEN_EMU_KERNEL(warp_ordered, true)

// A shuffle synchronises the lanes but orders no memory: reading a neighbour's slot after one races.
extern "C" __global__ void ordered_by_a_shuffle(int* out) {
  __shared__ int slots[64];
  const int t = threadIdx.x;
  slots[t] = t;
  const int v = __shfl_xor_sync(0xffffffffu, t, 1);
  out[t] = slots[t ^ 1] - v;
}
FLOWGEN_EMU_KERNEL(ordered_by_a_shuffle, true)

// The first 16 threads pass a barrier of their own: the block meets at two different __syncthreads.
extern "C" __global__ void divergent_barrier(int* out) {
  __shared__ int slots[64];
  const int t = threadIdx.x;
  if (t < 16) __syncthreads();
  slots[t] = t;
  __syncthreads();
  out[t] = slots[63 - t];
}
FLOWGEN_EMU_KERNEL(divergent_barrier, true)

// Threads past the first warp leave before the barrier the first warp waits at.
extern "C" __global__ void barrier_after_exit(int* out) {
  __shared__ int slots[64];
  const int t = threadIdx.x;
  if (t >= 32) return;
  slots[t] = t;
  __syncthreads();
  out[t] = slots[31 - t];
}
FLOWGEN_EMU_KERNEL(barrier_after_exit, true)

// Half of warp 0 shuffles while the rest of the block waits at __syncthreads.
extern "C" __global__ void barrier_against_shuffle(int* out) {
  const int t = threadIdx.x;
  int v = t;
  if (t < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  __syncthreads();
  out[t] = v;
}
FLOWGEN_EMU_KERNEL(barrier_against_shuffle, true)

// One past the end of a static array.
extern "C" __global__ void static_out_of_bounds(const int* in, int* out) {
  __shared__ int slots[64];
  const int t = threadIdx.x;
  slots[t + 1] = in[t];
  __syncthreads();
  out[t] = slots[t];
}
FLOWGEN_EMU_KERNEL(static_out_of_bounds, true)

// One past the end of the dynamic shared memory the launch gives (64 ints).
extern "C" __global__ void dynamic_out_of_bounds(const int* in, int* out) {
  FLOWGEN_DYN_SHARED(int, slots);
  const int t = threadIdx.x;
  slots[t + 1] = in[t];
  __syncthreads();
  out[t] = slots[t];
}
FLOWGEN_EMU_KERNEL(dynamic_out_of_bounds, true)

// A 16-byte vector store per thread, `offset` floats into dynamic shared memory.
extern "C" __global__ void vector_store(int offset, float* out) {
  FLOWGEN_DYN_SHARED(float, buf);
  const int t = threadIdx.x;
  *reinterpret_cast<float4*>(buf + offset + 4 * t) = make_float4(1.0f, 2.0f, 3.0f, 4.0f);
  __syncthreads();
  out[t] = buf[offset + 4 * t];
}
FLOWGEN_EMU_KERNEL(vector_store, true)

// A 16-byte cp.async per thread to shared memory at 16 t + `offset` bytes, or, with `to_global`,
// to global memory; then each thread reads its neighbour's copy.
extern "C" __global__ void async_copy(const float* src, int offset, int to_global, float* out) {
  FLOWGEN_DYN_SHARED(unsigned char, buf);
  const int t = threadIdx.x;
  void* dst = to_global ? static_cast<void*>(out + 4 * t) : static_cast<void*>(buf + offset + 16 * t);
  cp_async_cg(dst, src + 4 * t, 16);
  cp_async_commit();
  cp_async_wait_group<0>();
  __syncthreads();
  if (!to_global) out[t] = reinterpret_cast<const float*>(buf + offset)[4 * ((t + 1) % 32)];
}
FLOWGEN_EMU_KERNEL(async_copy, true)

// Reads the destination of its own cp.async before waiting for it.
extern "C" __global__ void read_before_wait(const float* src, float* out) {
  FLOWGEN_DYN_SHARED(float, buf);
  const int t = threadIdx.x;
  cp_async_cg(buf + 4 * t, src + 4 * t, 16);
  cp_async_commit();
  out[t] = buf[4 * t];
  cp_async_wait_group<0>();
}
FLOWGEN_EMU_KERNEL(read_before_wait, true)

// Each thread copies src[4t .. 4t + 3] to shared memory with cp.async and overwrites src[4t] with -1
// before waiting: the copy reads the old value or the new one, depending on where it lands.
extern "C" __global__ void source_changes_in_flight(float* src, float* out) {
  FLOWGEN_DYN_SHARED(float, buf);
  const int t = threadIdx.x;
  cp_async_cg(buf + 4 * t, src + 4 * t, 16);
  cp_async_commit();
  src[4 * t] = -1.0f;
  __syncwarp();
  cp_async_wait_group<0>();
  out[t] = buf[4 * t];
}
FLOWGEN_EMU_KERNEL(source_changes_in_flight, true)

// ldmatrix.x4 of four 8 x 8 16-bit matrices staged in shared memory, the row addresses shifted by
// `offset` bytes; with `from_global`, the rows are the global ones.
extern "C" __global__ void load_matrix(const unsigned short* tile, int offset, int from_global, unsigned* out) {
  FLOWGEN_DYN_SHARED(unsigned short, buf);
  const int lane = threadIdx.x;
  for (int i = lane; i < 4 * 64 + 8; i += 32) buf[i] = tile[i];
  __syncthreads();
  const unsigned short* base = from_global ? tile : buf;
  unsigned r[4];
  ldmatrix_x4(r, reinterpret_cast<const unsigned char*>(base + lane * 8) + offset);
  for (int j = 0; j < 4; ++j) out[4 * lane + j] = r[j];
}
FLOWGEN_EMU_KERNEL(load_matrix, true)

// One warpgroup: D (64 x 64) = A (64 x 16) B, with A[m][k] and B[n][k] bf16 copied into dynamic
// shared memory (K-major, unswizzled: element (mn, k) at (mn % 8) 8 + (mn / 8) 128 + (k / 8) 64 +
// k % 8, stride 256 bytes, leading 128 bytes) with plain stores, then one wgmma m64n64k16.
// `mode` breaks one rule: 1 reads an accumulator before the wait, 2 gives warp 1 another B
// descriptor, 3 leaves out fence.proxy.async, 4 has thread 0 overwrite B while the MMA may still
// read it; 0 breaks none.
extern "C" __global__ void warpgroup_mma(const unsigned short* a, const unsigned short* b, int mode, float* d) {
  FLOWGEN_DYN_SHARED(unsigned char, smem_raw);
  unsigned short* smem = reinterpret_cast<unsigned short*>(smem_raw + (1024 - shared_address(smem_raw) % 1024) % 1024);
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  for (int e = t; e < 64 * 16; e += 128) {
    const int mn = e / 16, k = e % 16, at = (mn % 8) * 8 + (mn / 8) * 128 + (k / 8) * 64 + k % 8;
    smem[at] = a[mn * 16 + k];
    smem[1024 + at] = b[mn * 16 + k];
  }
  if (mode != 3) fence_proxy_async_shared();
  __syncthreads();
  float acc[32];
  for (int r = 0; r < 32; ++r) acc[r] = 0.0f;
  const unsigned long long a_desc = wgmma_descriptor(smem, 128, 256, WGMMA_INTERLEAVE);
  const unsigned long long b_desc = wgmma_descriptor(smem + 1024 + (mode == 2 && warp == 1 ? 64 : 0), 128, 256,
                                                     WGMMA_INTERLEAVE);
  wgmma_fence();
  wgmma_m64n64k16_bf16<0, 0>(acc, a_desc, b_desc, 0);
  wgmma_commit_group();
  const float early = mode == 1 ? acc[0] : 0.0f;
  __syncwarp();   // every lane of the warp has issued its part of the MMA
  if (mode == 4 && t == 0) smem[1024] = 0;
  wgmma_wait_group<0>();
  for (int r = 0; r < 32; ++r) {
    const int row = 16 * warp + lane / 4 + 8 * (r / 2 % 2), col = 8 * (r / 4) + 2 * (lane % 4) + r % 2;
    d[row * 64 + col] = acc[r] + early;
  }
}
FLOWGEN_EMU_KERNEL(warpgroup_mma, true)

// A barrier in a kernel registered as one that never synchronises.
extern "C" __global__ void misregistered(int* out) {
  __syncthreads();
  out[threadIdx.x] = 1;
}
FLOWGEN_EMU_KERNEL(misregistered, false)
"""


@pytest.fixture(scope="module")
def check_mode():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLOWGEN_EMULATOR_CHECK", "1")
        yield patch


@pytest.fixture(scope="module")
def hazards(check_mode):
    return CpuModule(build_cpu_library(HAZARDS, "test_emulator_check"))


def ptr(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def ints(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32)


def report_of(module, kernel, grid, block, smem, *args) -> str:
    """The checker's report of a launch that must fail."""
    args = [a if isinstance(a, ctypes._SimpleCData) else ptr(a) for a in args]
    with pytest.raises(EmulatorCheckError) as failure:
        module.launch(kernel, grid, block, smem, args)
    return str(failure.value)


def assert_names(report: str, kernel: str, block: tuple, thread: tuple, address: str | None):
    """The report names the kernel, the block, the thread and (where there is one) the address."""
    assert f"in kernel {kernel}," in report, report
    assert f"block ({block[0]}, {block[1]}, {block[2]})" in report, report
    assert f"thread ({thread[0]}, {thread[1]}, {thread[2]})" in report.split("in kernel")[1], report
    if address is not None:
        assert f"address {address}" in report, report


def test_the_hazard_kernels_are_cuda_that_nvrtc_compiles():
    """The kernels are CUDA C++ for the GPU as they stand; ptxas refuses the one over 48 KB of
    static shared memory, as the checker does."""
    cubin = nvrtc.compile_cuda(HAZARDS.replace(TOO_MUCH_STATIC_SHARED, ""), arch="sm_90", tag="test_emulator_check")
    assert cubin[:4] == b"\x7fELF"
    with pytest.raises(CompileError, match="too_much_static_shared' uses too much shared data"):
        nvrtc.compile_cuda(TOO_MUCH_STATIC_SHARED, arch="sm_90", tag="test_emulator_check_static")


def test_check_mode_is_switched_by_the_environment(check_mode, hazards):
    assert hazards.checked and "-fsanitize=thread" in cpu_compiler.kernel_flags()
    check_mode.setenv("FLOWGEN_EMULATOR_CHECK", "yes")
    with pytest.raises(ValueError, match="FLOWGEN_EMULATOR_CHECK='yes'"):
        cpu_compiler.kernel_flags()
    check_mode.setenv("FLOWGEN_EMULATOR_CHECK", "0")
    assert "-fsanitize=thread" not in cpu_compiler.kernel_flags()
    check_mode.setenv("FLOWGEN_EMULATOR_CHECK", "1")


def test_shared_memory_race_read_after_write(hazards):
    report = report_of(hazards, "read_after_write", (2, 1, 1), (64, 1, 1), 0, ints(64), ints(64))
    assert "read-after-write race" in report and "thread (0, 0, 0) [warp 0 lane 0] wrote" in report
    assert_names(report, "read_after_write", (0, 0, 0), (1, 0, 0), "")
    assert "static shared `read_after_write::slots` + 0 (of 256 bytes)" in report


def test_shared_memory_race_write_after_read(hazards):
    report = report_of(hazards, "write_after_read", (2, 1, 1), (64, 1, 1), 0, ints(64))
    assert "write-after-read race" in report and "thread (0, 0, 0) [warp 0 lane 0] read" in report
    assert_names(report, "write_after_read", (0, 0, 0), (1, 0, 0), "")
    assert "static shared `write_after_read::slots` + 4 (of 256 bytes)" in report


def test_shared_memory_race_write_after_write(hazards):
    report = report_of(hazards, "write_after_write", (1, 1, 1), (64, 1, 1), 0, ints(64))
    assert "write-after-write race" in report and "thread (0, 0, 0) [warp 0 lane 0] wrote" in report
    assert_names(report, "write_after_write", (0, 0, 0), (1, 0, 0), "")
    assert "static shared `write_after_write::slots` + 0" in report


def test_lanes_ordered_by_syncwarp_run_clean(hazards):
    out = np.zeros(64, np.int32)
    hazards.launch("warp_ordered", (1, 1, 1), (64, 1, 1), 0, [ptr(out)])
    np.testing.assert_array_equal(out, ints(64) ^ 1)


def test_a_shuffle_does_not_order_shared_memory(hazards):
    report = report_of(hazards, "ordered_by_a_shuffle", (1, 1, 1), (64, 1, 1), 0, ints(64))
    assert "read-after-write race" in report and "thread (1, 0, 0) [warp 0 lane 1] wrote" in report
    assert_names(report, "ordered_by_a_shuffle", (0, 0, 0), (0, 0, 0), "")
    assert "static shared `ordered_by_a_shuffle::slots` + 4" in report


def test_divergent_barrier(hazards):
    report = report_of(hazards, "divergent_barrier", (1, 1, 1), (64, 1, 1), 0, ints(64))
    assert "barrier not reached by every thread" in report
    assert "waits at the __syncthreads at line" in report
    assert_names(report, "divergent_barrier", (0, 0, 0), (16, 0, 0), None)


def test_barrier_that_exited_threads_never_reach(hazards):
    report = report_of(hazards, "barrier_after_exit", (1, 1, 1), (64, 1, 1), 0, ints(64))
    assert "the thread exits while thread (0, 0, 0) [warp 0 lane 0] waits at the __syncthreads" in report
    assert_names(report, "barrier_after_exit", (0, 0, 0), (32, 0, 0), None)


def test_barrier_against_a_warp_shuffle(hazards):
    report = report_of(hazards, "barrier_against_shuffle", (1, 1, 1), (64, 1, 1), 0, ints(64))
    assert "waits at __syncthreads" in report and "waits at a warp-synchronous operation" in report
    assert_names(report, "barrier_against_shuffle", (0, 0, 0), (16, 0, 0), None)


def test_static_shared_memory_one_past_the_array(hazards):
    report = report_of(hazards, "static_out_of_bounds", (1, 1, 1), (64, 1, 1), 0, ints(64), ints(64))
    assert "writes 4 bytes outside the kernel's static shared memory" in report
    assert_names(report, "static_out_of_bounds", (0, 0, 0), (63, 0, 0), "")
    assert "0 bytes past the end of `static_out_of_bounds::slots`" in report


def test_dynamic_shared_memory_one_past_the_end(hazards):
    report = report_of(hazards, "dynamic_out_of_bounds", (1, 1, 1), (64, 1, 1), 256, ints(64), ints(64))
    assert "writes 4 bytes outside the 256 bytes of dynamic shared memory" in report
    assert_names(report, "dynamic_out_of_bounds", (0, 0, 0), (63, 0, 0), "")
    assert "dynamic shared memory + 256 (shared-window address 272)" in report


def test_shared_memory_limits_refuse_the_launch(hazards):
    report = report_of(hazards, "too_much_static_shared", (1, 1, 1), (64, 1, 1), 0, ints(64))
    assert "49156 bytes of static shared memory: a kernel may declare at most 48 KB" in report
    assert "in kernel too_much_static_shared (grid 1 x 1 x 1, block 64 x 1 x 1)" in report
    report = report_of(hazards, "dynamic_out_of_bounds", (1, 1, 1), (64, 1, 1), 227 * 1024 + 1, ints(64), ints(64))
    assert "232449 bytes of shared memory per block (0 static, 232449 dynamic)" in report
    report = report_of(hazards, "warp_ordered", (1, 1, 1), (1056, 1, 1), 0, ints(1056))
    assert "a block of 1056 threads" in report


def test_misaligned_vector_access(hazards):
    out = np.zeros(32, np.float32)
    hazards.launch("vector_store", (1, 1, 1), (32, 1, 1), 1024, [ctypes.c_int(4), ptr(out)])
    assert (out == 1).all()
    report = report_of(hazards, "vector_store", (1, 1, 1), (32, 1, 1), 1024, ctypes.c_int(2), out)
    assert "misaligned 16-byte access: the thread writes an address that is not a multiple of 16" in report
    assert_names(report, "vector_store", (0, 0, 0), (0, 0, 0), "")
    assert "dynamic shared memory + 8 (shared-window address 24)" in report


def test_cp_async_misaligned_or_outside_shared_memory(hazards):
    src, out = np.arange(128, dtype=np.float32), np.zeros(32, np.float32)
    hazards.launch("async_copy", (1, 1, 1), (32, 1, 1), 1024, [ptr(src), ctypes.c_int(0), ctypes.c_int(0), ptr(out)])
    np.testing.assert_array_equal(out, src[4 * ((np.arange(32) + 1) % 32)])
    report = report_of(hazards, "async_copy", (1, 1, 1), (32, 1, 1), 1024, src, ctypes.c_int(4), ctypes.c_int(0), out)
    assert "misaligned cp.async destination (16 bytes)" in report
    assert_names(report, "async_copy", (0, 0, 0), (0, 0, 0), "")
    assert "dynamic shared memory + 4 (shared-window address 20)" in report
    out = np.zeros(128, np.float32)
    report = report_of(hazards, "async_copy", (1, 1, 1), (32, 1, 1), 1024, src, ctypes.c_int(0), ctypes.c_int(1), out)
    assert "cp.async destination outside shared memory" in report
    assert_names(report, "async_copy", (0, 0, 0), (0, 0, 0), hex(out.ctypes.data))


def test_reading_a_cp_async_destination_before_the_wait(hazards):
    src = np.arange(128, dtype=np.float32)
    report = report_of(hazards, "read_before_wait", (1, 1, 1), (32, 1, 1), 1024, src, np.zeros(32, np.float32))
    assert "reads shared memory that a cp.async of thread (0, 0, 0) [warp 0 lane 0] still writes" in report
    assert_names(report, "read_before_wait", (0, 0, 0), (0, 0, 0), "")
    assert "dynamic shared memory + 0 (shared-window address 16)" in report


def test_cp_async_lands_at_a_seeded_random_point_before_the_wait(hazards, check_mode):
    """Each copy reads its source somewhere between issue and wait: before the thread overwrites
    src[4t] (it copies 4t) or after (it copies -1). The seed decides; the same seed decides alike."""
    def landed(seed):
        check_mode.setenv("FLOWGEN_EMULATOR_CHECK_SEED", str(seed))
        src, out = np.arange(128, dtype=np.float32), np.zeros(32, np.float32)
        hazards.launch("source_changes_in_flight", (1, 1, 1), (32, 1, 1), 512, [ptr(src), ptr(out)])
        assert set(out) <= {-1.0} | set(4.0 * np.arange(32))
        return out != -1.0

    early = [landed(seed) for seed in range(4)]
    check_mode.delenv("FLOWGEN_EMULATOR_CHECK_SEED")
    assert 0 < sum(e.sum() for e in early) < 4 * 32      # some copies land at issue, some later
    assert len({e.tobytes() for e in early}) > 1           # and where depends on the seed
    np.testing.assert_array_equal(landed(2), early[2])


def test_ldmatrix_misaligned_or_outside_shared_memory(hazards):
    tile, out = np.arange(4 * 64 + 8, dtype=np.uint16), np.zeros(128, np.uint32)
    hazards.launch("load_matrix", (1, 1, 1), (32, 1, 1), 1024, [ptr(tile), ctypes.c_int(0), ctypes.c_int(0), ptr(out)])
    lane = np.arange(32)
    np.testing.assert_array_equal(out.reshape(32, 4)[:, 0] & 0xFFFF, (lane // 4) * 8 + 2 * (lane % 4))
    report = report_of(hazards, "load_matrix", (1, 1, 1), (32, 1, 1), 1024, tile, ctypes.c_int(4), ctypes.c_int(0), out)
    assert "misaligned ldmatrix row address: the address is not a multiple of 16" in report
    assert_names(report, "load_matrix", (0, 0, 0), (0, 0, 0), "")
    assert "dynamic shared memory + 4 (shared-window address 20)" in report
    report = report_of(hazards, "load_matrix", (1, 1, 1), (32, 1, 1), 1024, tile, ctypes.c_int(0), ctypes.c_int(1), out)
    assert "ldmatrix row address outside shared memory" in report
    assert_names(report, "load_matrix", (0, 0, 0), (0, 0, 0), hex(tile.ctypes.data))


def run_warpgroup_mma(hazards, mode):
    rng = np.random.default_rng(0)
    a, b = (rng.integers(-3, 4, (64, 16)).astype(ml_dtypes.bfloat16) for _ in range(2))
    d = np.zeros((64, 64), np.float32)
    args = [ptr(a.view(np.uint16)), ptr(b.view(np.uint16)), ctypes.c_int(mode), ptr(d)]
    if mode == 0:
        hazards.launch("warpgroup_mma", (1, 1, 1), (128, 1, 1), 1024 + 4096, args)
        np.testing.assert_array_equal(d, a.astype(np.float32) @ b.astype(np.float32).T)
        return None
    return report_of(hazards, "warpgroup_mma", (1, 1, 1), (128, 1, 1), 1024 + 4096, *args)


def test_wgmma_by_the_rules_runs_clean(hazards):
    run_warpgroup_mma(hazards, 0)


def test_wgmma_accumulators_read_before_the_wait(hazards):
    report = run_warpgroup_mma(hazards, 1)
    assert "the thread reads wgmma accumulators before wgmma_wait_group retired the MMA that writes them" in report
    assert_names(report, "warpgroup_mma", (0, 0, 0), (0, 0, 0), "0x")


def test_wgmma_descriptors_that_differ_within_the_warpgroup(hazards):
    report = run_warpgroup_mma(hazards, 2)
    assert "wgmma operands differ within the warpgroup" in report
    assert "thread (0, 0, 0) [warp 0 lane 0] passed" in report
    assert_names(report, "warpgroup_mma", (0, 0, 0), (32, 0, 0), None)


def test_wgmma_reading_generic_writes_without_fence_proxy_async(hazards):
    report = run_warpgroup_mma(hazards, 3)
    assert "missing fence.proxy.async" in report and "thread (0, 0, 0) [warp 0 lane 0] wrote" in report
    assert_names(report, "warpgroup_mma", (0, 0, 0), (0, 0, 0), "")
    assert "dynamic shared memory + 1008 (shared-window address 1024)" in report   # A's first element


def test_overwriting_a_wgmma_operand_before_the_wait(hazards):
    report = run_warpgroup_mma(hazards, 4)
    assert "write-after-read race: the thread writes shared memory that a wgmma in flight reads" in report
    assert_names(report, "warpgroup_mma", (0, 0, 0), (0, 0, 0), "")
    assert "dynamic shared memory + 3056 (shared-window address 3072)" in report   # B's first element


def test_a_barrier_in_a_kernel_registered_without_fibers(hazards):
    report = report_of(hazards, "misregistered", (1, 1, 1), (4, 1, 1), 0, ints(4))
    assert "__syncthreads called by a kernel registered with FLOWGEN_EMU_KERNEL(name, false)" in report
    assert_names(report, "misregistered", (0, 0, 0), (0, 0, 0), None)


def test_a_failed_launch_leaves_the_next_one_clean(hazards):
    report_of(hazards, "read_before_wait", (1, 1, 1), (32, 1, 1), 1024, np.zeros(128, np.float32),
              np.zeros(32, np.float32))
    run_warpgroup_mma(hazards, 0)


# ---------------------------------------------------------------------------------------
# Generated kernels through the public API: a bf16 training step of a model with a conv, a
# linear layer, causal attention, a reduction and elementwise functions, rendered for a GPU and
# run by the checking emulator (on a machine with a GPU too), for sm_80 (mma.sync) and sm_90
# (wgmma). At -O0: the step is small and g++ compiles three times faster.

class ConvAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.proj = nn.Linear(8, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        tokens = self.proj(nn.functional.relu(self.conv(x)).flatten(2).transpose(1, 2))
        q = tokens.unsqueeze(1).to(flow.bfloat16)
        attended = nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).to(flow.float32)
        return self.head(nn.functional.gelu(attended.squeeze(1)).mean(1))


def checked_training_steps():
    flow.manual_seed(0)
    model = ConvAttention().to("cuda")
    graph = TrainGraph(model, nn.CrossEntropyLoss(), flow.optim.SGD(model.parameters(), lr=0.1))
    graph.config.enable_amp(True, dtype=flow.bfloat16)
    x, y = flow.randn(2, 4, 5, 6).to("cuda"), flow.tensor(np.array([1, 3])).to("cuda")
    losses = [float(graph(x, y)) for _ in range(2)]
    return losses, [p.numpy() for p in model.parameters()], graph.compiled.program.kernels


@pytest.fixture
def emulated_gpu(check_mode, monkeypatch):
    monkeypatch.setattr(cuda_driver, "available", lambda: False)
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA", "1")
    monkeypatch.setenv("FLOWGEN_EMULATOR_OPT", "0")


def test_generated_kernels_of_every_family_run_clean(emulated_gpu, monkeypatch):
    sm80_losses, sm80_params, sm80_kernels = checked_training_steps()
    monkeypatch.setenv("FLOWGEN_EMULATE_CUDA_ARCH", "sm_90")
    sm90_losses, sm90_params, sm90_kernels = checked_training_steps()

    def comments(kernels):
        return " | ".join(k.comment for k in kernels)
    for engine, kernels in (("bf16 mma.sync", sm80_kernels), ("bf16 wgmma", sm90_kernels)):
        text = comments(kernels)
        assert f"implicit GEMM 64x64 on tensor cores, {engine}" in text          # conv and its weight gradient
        assert f"tensor-core GEMM 64x64, {engine}" in text                        # a linear layer's gradient
        assert "attention [2, 1, 30, 32]" in text and "-> dK" in text and "bf16 mma.sync" in text
        assert "cross_entropy_rows over dim 1" in text and "mean" in text and "gelu" in text
    # The emulator adds each output's products in increasing k on both tensor-core paths.
    assert sm80_losses == sm90_losses and sm80_losses[1] < sm80_losses[0]
    for p, q in zip(sm80_params, sm90_params):
        np.testing.assert_array_equal(p, q)


def test_a_hazard_in_a_graph_kernel_raises_through_the_executor(emulated_gpu, monkeypatch):
    """A tiled attention kernel launched with half its shared memory copies its K/V tiles past the
    end: the graph's call raises, naming the kernel the executor launched."""
    from flowgen.codegen.kernels import attention

    monkeypatch.setattr(attention, "_attention_kernel", shrink_shared_memory(attention._attention_kernel))
    flow.manual_seed(0)
    q = flow.randn(1, 1, 30, 16).to("cuda").to(flow.bfloat16)

    class Attend(nn.Graph):
        def build(self, q):
            return nn.functional.scaled_dot_product_attention(q, q, q)

    with pytest.raises(EmulatorCheckError) as failure:
        Attend()(q)
    report = str(failure.value)
    assert "cp.async destination outside shared memory" in report   # the K/V tiles are copied by cp.async
    assert "launched as k0_graph_attention (<graph>: attention [1, 1, 30, 16]" in report


def shrink_shared_memory(make_kernel):
    def smaller(*args, **kwargs):
        kernel = make_kernel(*args, **kwargs)
        kernel.smem //= 2
        return kernel
    return smaller


# A test of another file that breaks the hardware's rules on purpose, so the checking emulator
# fails it: the wgmma primitive test reads the accumulators between commit and wait on the
# emulator only (to show they are not ready; undefined behaviour on a GPU, issue 29).
BREAK_THE_RULES = ["test_wgmma_reads_canonical_layouts_through_descriptors"]


@pytest.mark.slow
def test_tensor_core_and_kernel_family_test_files_pass_under_the_checking_emulator():
    """Every tensor-core and kernel-family test, run by the checking emulator (minutes)."""
    files = [f"tests/{name}.py" for name in ("test_tensor_cores", "test_wgmma", "test_wgmma_conv",
                                             "test_attention_tiled", "test_kernel_families", "test_emulator")]
    command = [sys.executable, "-m", "pytest", "-q", "-m", "not gpu and not slow", *files,
               "-k", " and ".join(f"not {name}" for name in BREAK_THE_RULES)]
    result = subprocess.run(command, cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                            env=dict(os.environ, FLOWGEN_EMULATOR_CHECK="1"))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
