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

// ---------------------------------------------------------------------------------------
// Hopper warpgroup MMA (sm_90a only: NVRTC's --gpu-architecture=sm_90a defines
// __CUDA_ARCH_FEAT_SM90_ALL). A warpgroup is 4 consecutive warps (threads 128 g .. 128 g + 127);
// its 128 threads issue each of these together. flowgen_emu.h implements the same functions.
// PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions".
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Swizzle modes of a matrix descriptor (bits 62-63).
#define WGMMA_INTERLEAVE 0
#define WGMMA_SWIZZLE_128B 1
#define WGMMA_SWIZZLE_64B 2
#define WGMMA_SWIZZLE_32B 3

// The 64-bit shared-memory matrix descriptor of an operand tile: bits 0-13 its start address,
// 16-29 the leading dimension byte offset, 32-45 the stride dimension byte offset (each >> 4),
// 49-51 the base offset (0: the swizzle pattern is aligned to its repeat, 1024 bytes for
// 128B), 62-63 the swizzle mode. What the offsets step over depends on the canonical layout
// (flowgen_emu.h: `canonical_address`).
__device__ __forceinline__ unsigned long long wgmma_descriptor(const void* tile, unsigned leading_bytes,
                                                               unsigned stride_bytes, int swizzle) {
  return (unsigned long long)((shared_address(tile) & 0x3FFFF) >> 4) |
         (unsigned long long)((leading_bytes & 0x3FFFF) >> 4) << 16 |
         (unsigned long long)((stride_bytes & 0x3FFFF) >> 4) << 32 |
         (unsigned long long)swizzle << 62;
}

// wgmma.fence: orders this thread's earlier register accesses (the accumulators) before the
// warpgroup MMAs that follow; needed before the first wgmma and after touching accumulators.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the group of wgmma.mma_async issued since the last commit.
__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups are in flight; only then are their accumulators
// (and the shared memory they read) safe to touch.
template <int N> __device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Pins the accumulator registers at this point of the program: the compiler sees each read and
// written here, so it neither moves their uses across a wgmma_wait_group nor copies them while an
// MMA is in flight (wgmma's register operands are asynchronous, which the compiler does not know).
template <int N> __device__ __forceinline__ void wgmma_fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// Makes this thread's shared-memory writes through the generic proxy (st.shared, cp.async)
// visible to the async proxy that wgmma reads operands through; then a barrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// D (64 x N, fp32) = A (64 x 16) * B (16 x N) + (scale_d ? D : 0), A and B read from shared
// memory through their descriptors; TransA / TransB = 0: K-major tiles, 1: M- / N-major.
// Accumulator register r of thread t (warp w = t % 128 / 32, lane l) is
// D(16 w + l / 4 + 8 ((r / 2) % 2), 8 (r / 4) + 2 (l % 4) + r % 2). Asynchronous: the registers
// hold the result only after wgmma_commit_group + wgmma_wait_group.
#define FLOWGEN_WGMMA_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                            "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define FLOWGEN_WGMMA_D32_AT(i) FLOWGEN_WGMMA_D8(i), FLOWGEN_WGMMA_D8(i + 8), FLOWGEN_WGMMA_D8(i + 16), \
                                FLOWGEN_WGMMA_D8(i + 24)
#define FLOWGEN_WGMMA_D32 FLOWGEN_WGMMA_D32_AT(0)
#define FLOWGEN_WGMMA_D64 FLOWGEN_WGMMA_D32_AT(0), FLOWGEN_WGMMA_D32_AT(32)
#define FLOWGEN_WGMMA_D128 FLOWGEN_WGMMA_D64, FLOWGEN_WGMMA_D32_AT(64), FLOWGEN_WGMMA_D32_AT(96)
#define FLOWGEN_WGMMA_SS(fname, N, type, regs, args, a_at, b_at, p_at, ta_at, tb_at)                     \
  template <int TransA, int TransB>                                                                  \
  __device__ __forceinline__ void fname(float (&d)[N / 2], unsigned long long a_desc,                 \
                                        unsigned long long b_desc, int scale_d) {                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" p_at ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." type "." type " {" regs "}, "      \
                 "%" a_at ", %" b_at ", p, 1, 1, %" ta_at ", %" tb_at ";\n}\n"                         \
                 : args : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(TransA), "n"(TransB));          \
  }
FLOWGEN_WGMMA_SS(wgmma_m64n64k16_bf16, 64, "bf16", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", FLOWGEN_WGMMA_D32, "32", "33", "34", "35", "36")
FLOWGEN_WGMMA_SS(wgmma_m64n64k16_f16, 64, "f16", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", FLOWGEN_WGMMA_D32, "32", "33", "34", "35", "36")
FLOWGEN_WGMMA_SS(wgmma_m64n128k16_bf16, 128, "bf16", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63", FLOWGEN_WGMMA_D64, "64", "65", "66", "67", "68")
FLOWGEN_WGMMA_SS(wgmma_m64n128k16_f16, 128, "f16", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63", FLOWGEN_WGMMA_D64, "64", "65", "66", "67", "68")
FLOWGEN_WGMMA_SS(wgmma_m64n256k16_bf16, 256, "bf16", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127", FLOWGEN_WGMMA_D128, "128", "129", "130", "131", "132")
FLOWGEN_WGMMA_SS(wgmma_m64n256k16_f16, 256, "f16", "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127", FLOWGEN_WGMMA_D128, "128", "129", "130", "131", "132")
#undef FLOWGEN_WGMMA_SS
// The tf32 forms: m64nNk8 (k8 slices of 32 bytes), fp32 operands whose low 13 bits the tensor core
// ignores (kernels round them with float_to_tf32 first); both tiles K-major (the PTX ISA has no
// transpose for .tf32), so TransA and TransB must be 0.
#define FLOWGEN_WGMMA_SS_TF32(fname, N, regs, args, a_at, b_at, p_at)                                     \
  template <int TransA, int TransB>                                                                  \
  __device__ __forceinline__ void fname(float (&d)[N / 2], unsigned long long a_desc,                 \
                                        unsigned long long b_desc, int scale_d) {                    \
    static_assert(TransA == 0 && TransB == 0, "wgmma .tf32 reads K-major tiles only");               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" p_at ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 {" regs "}, "                 \
                 "%" a_at ", %" b_at ", p, 1, 1;\n}\n"                                                  \
                 : args : "l"(a_desc), "l"(b_desc), "r"(scale_d));                                    \
  }
FLOWGEN_WGMMA_SS_TF32(wgmma_m64n64k8_tf32, 64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", FLOWGEN_WGMMA_D32, "32", "33", "34")
FLOWGEN_WGMMA_SS_TF32(wgmma_m64n128k8_tf32, 128, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63", FLOWGEN_WGMMA_D64, "64", "65", "66")
FLOWGEN_WGMMA_SS_TF32(wgmma_m64n256k8_tf32, 256, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127", FLOWGEN_WGMMA_D128, "128", "129", "130")
#undef FLOWGEN_WGMMA_SS_TF32

#endif  // sm_90a
#endif

// Device functions shared by generated kernels on both targets.
#include "flowgen_philox.h"

// max / min of two floating values that propagate NaN, as PyTorch's max/min reductions do
// (fmaxf/fminf return the other operand when one is NaN, which hid a NaN from amax's result).
__device__ __forceinline__ float flowgen_max(float a, float b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ float flowgen_min(float a, float b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ double flowgen_max(double a, double b) { return (a > b || a != a) ? a : b; }
__device__ __forceinline__ double flowgen_min(double a, double b) { return (a < b || a != a) ? a : b; }

// pow by the operands' type: float/double math for floating values; for integers, exact
// repeated squaring that wraps around on overflow as PyTorch's integer pow does (powf rounded
// 5000001 ** 2 to 25000010579968). A negative integer exponent gives what PyTorch's integer pow
// kernel gives: 1 / a truncated (1 for a == 1, +-1 for a == -1, else 0).
__device__ __forceinline__ float flowgen_pow_same(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double flowgen_pow_same(double a, double b) { return pow(a, b); }
template <class T> __device__ __forceinline__ T flowgen_pow_same(T a, T b) {
  if (b < 0) return a == 1 ? T(1) : (a == -1 ? ((b & 1) ? T(-1) : T(1)) : T(0));
  unsigned long long base = (unsigned long long)a, result = 1, e = (unsigned long long)b;
  for (; e; e >>= 1, base *= base) if (e & 1) result *= base;
  return (T)result;
}
// (the operands in their common type: a literal exponent is an int)
template <class A, class B> __device__ __forceinline__ auto flowgen_pow(A a, B b) -> decltype(a + b) {
  return flowgen_pow_same((decltype(a + b))a, (decltype(a + b))b);
}

// ~a of integer and bool values (bitwise_not): C++'s ~ turns true into -2, which is true again.
__device__ __forceinline__ bool flowgen_bitwise_not(bool a) { return !a; }
template <class T> __device__ __forceinline__ T flowgen_bitwise_not(T a) { return ~a; }

// Floor division as PyTorch (and Python, NumPy): the floor of the exact quotient a / b, from
// fmod, not floor of the rounded a / b (2.0999999f // 0.69999999f is 2, floorf(a / b) is 3).
template <class T> __device__ __forceinline__ T flowgen_floor_divide(T a, T b) {
  if (b == T(0)) return a / b;
  const T mod = fmod(a, b);
  T div = (a - mod) / b;
  if (mod != T(0) && ((b < T(0)) != (mod < T(0)))) div -= T(1);
  if (div == T(0)) return copysign(T(0), a / b);
  T floordiv = floor(div);
  if (div - floordiv > T(0.5)) floordiv += T(1);
  return floordiv;
}

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
#ifdef FLOWGEN_EMULATOR
// g++ compiles the kernels in chunks that one library or program links: a weak definition is one
// record however many chunks define it (plain definitions each made their own copy, an ODR
// violation AddressSanitizer stops a sanitized program for). Not `inline`: g++ makes that a
// process-wide unique symbol, one record shared by every graph's library.
__attribute__((weak)) FlowgenIndexError flowgen_index_error;
#else
__device__ FlowgenIndexError flowgen_index_error;
#endif
}

__device__ inline void flowgen_report_bad_index(unsigned long long check, long long value) {
  // atomicCAS: when many threads (or several checks) fail, the first one to get here wins.
  if (atomicCAS(&flowgen_index_error.check, 0ULL, check) == 0ULL) flowgen_index_error.value = value;
}
