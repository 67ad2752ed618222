// flowgen_cuda_prelude.h: what generated kernels need on top of CUDA C++, for NVRTC.
// It defines the same macro names as flowgen_emu.h so one source builds for both; a source
// that includes this header also builds for the emulator, where it pulls in flowgen_emu.h.
#pragma once

#if defined(FLOWGEN_EMULATOR)
#include "flowgen_emu.h"
#else
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Dynamic shared memory as a typed pointer; every FLOWGEN_DYN_SHARED in a kernel aliases
// the same launch-sized buffer, exactly as `extern __shared__` arrays do.
#define FLOWGEN_DYN_SHARED(T, name)                             \
  extern __shared__ __align__(16) unsigned char name##_raw[];   \
  T* name = reinterpret_cast<T*>(name##_raw)

// NVRTC has no <math.h>/<climits>: the constants generated reductions use as identities.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
#ifndef LLONG_MAX
#define LLONG_MAX 9223372036854775807LL
#define LLONG_MIN (-LLONG_MAX - 1LL)
#endif

// Only the emulator needs a host-callable launcher per kernel.
#define FLOWGEN_EMU_KERNEL(kname, needs_fibers)

// ---------------------------------------------------------------------------------------
// Tensor-core primitives (sm_80 and newer): warp-level mma.sync, ldmatrix and cp.async as
// named functions. flowgen_emu.h defines the same functions for the CPU emulator, with the
// fragment layouts of the PTX ISA (section "Warp Level Matrix Multiply-Accumulate
// Instructions": matrix fragments for mma.m16n8k16 and mma.m16n8k8, and ldmatrix).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// acc (16 x 8, fp32) += A (16 x 16, row-major) * B (16 x 8, column-major). Lane l holds
// a[] = A(g, 2t..2t+1), A(g+8, 2t..), A(g, 2t+8..), A(g+8, 2t+8..); b[] = B(2t..2t+1, g),
// B(2t+8.., g); acc[] = C(g, 2t), C(g, 2t+1), C(g+8, 2t), C(g+8, 2t+1), with g = l / 4, t = l % 4.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_m16n8k16_f16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// acc (16 x 8) += A (16 x 8, tf32) * B (8 x 8, tf32): a[] = A(g, t), A(g+8, t), A(g, t+4),
// A(g+8, t+4); b[] = B(t, g), B(t+4, g); acc as for m16n8k16.
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// An fp32 value rounded to tf32 (nearest, ties away from zero), as an mma operand.
__device__ __forceinline__ unsigned float_to_tf32(float x) {
  unsigned out;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(out) : "f"(x));
  return out;
}

// ldmatrix: lanes 8j..8j+7 pass the shared-memory addresses of the 8 rows (16 bytes each) of
// matrix j; register j of lane l receives row l / 4, columns 2 (l % 4), 2 (l % 4) + 1 of it
// (.trans: column l / 4, rows 2 (l % 4), 2 (l % 4) + 1).
__device__ __forceinline__ void ldmatrix_x1(unsigned (&r)[1], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x1_trans(unsigned (&r)[1], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
}

// cp.async: copy `Bytes` from global to shared memory without a register round trip; only
// the first `src_bytes` are read, the rest of the destination is zero-filled (src_bytes = 0
// fills a tile edge with zeros). .ca caches in L1, .cg (16 bytes only) bypasses it.
template <int Bytes> __device__ __forceinline__ void cp_async_ca(void* smem, const void* gmem, int src_bytes) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async.ca copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
               :: "r"(shared_address(smem)), "l"(gmem), "n"(Bytes), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_cg(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(shared_address(smem)), "l"(gmem), "r"(src_bytes) : "memory");
}
// Closes the group of this thread's cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

#endif  // __CUDA_ARCH__ >= 800
#endif

// Device functions shared by generated kernels on both targets.
#include "flowgen_philox.h"

// ---------------------------------------------------------------------------------------
// The program's index-error record. A kernel that reads a tensor as indices (cross-entropy
// labels, gather / index_select / embedding / scatter indices) checks each index; one out of
// range is never used to read or write, and the first such index of a step is recorded here:
// `check` names the failing bounds check (Program.index_checks, numbered from 1; 0 means no
// error) and `value` is the index it read. The host reads the record after every step, raises
// (Python) or exits (standalone program) naming the op, and clears it.
struct FlowgenIndexError {
  unsigned long long check;
  long long value;
};
extern "C" {
__device__ FlowgenIndexError flowgen_index_error;
}

__device__ inline void flowgen_report_bad_index(unsigned long long check, long long value) {
  // atomicCAS: when many threads (or several checks) fail, the first one to get here wins.
  if (atomicCAS(&flowgen_index_error.check, 0ULL, check) == 0ULL) flowgen_index_error.value = value;
}
