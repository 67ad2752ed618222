// flowgen_emu.h: compile generated CUDA C++ unchanged with g++ (-std=c++17 -fopenmp)
// and run it on the CPU.
//
// Execution model
//   * Blocks run in parallel: one OpenMP `parallel for` iteration per block.
//   * The threads of a block run on the OS thread that owns the block, one after another.
//     Kernels without barriers or warp intrinsics take a plain loop over the threads.
//     Kernels that synchronise run each thread as a fiber; a barrier switches to
//     the next fiber, so per-OS-thread storage is per-block storage (`__shared__`).
//   * Atomics are real atomics, because blocks do run concurrently.
//
// Kernel authors write `extern "C" __global__ void k(...)` followed by
// `FLOWGEN_EMU_KERNEL(k, needs_fibers)`, which here defines the C entry point
// `flowgen_launch_k` and in flowgen_cuda_prelude.h expands to nothing. Written for the
// emulator only, `FLOWGEN_EMU_KERNEL(k, flowgen_emu::SerialBlocks{work})` says each block is one
// thread doing a serial job of about `work` multiply-adds (a GEMM tile): its blocks run in
// parallel when the whole grid's work is large, however few they are.
#pragma once

#ifndef FLOWGEN_EMULATOR
#define FLOWGEN_EMULATOR 1
#endif

#include <ucontext.h>  // fibers on targets other than x86-64

#include <algorithm>
#include <cstdarg>
#include <initializer_list>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------------------------------
// CUDA qualifiers. `__restrict__` is already a g++ keyword.
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
// The emulator's own reads and writes of shared memory and accumulators on behalf of a primitive
// (ldmatrix, cp.async landing, wgmma): the checking mode accounts for them itself.
#ifdef FLOWGEN_EMU_CHECK
#define FLOWGEN_EMU_UNCHECKED __attribute__((no_sanitize_thread))
#else
#define FLOWGEN_EMU_UNCHECKED
#endif
// A block's threads all run on one OS thread and blocks on an OS thread run one at a
// time, so a thread_local static is exactly one copy per running block. The checking mode
// (flowgen_emu_check.h) runs one block at a time and keeps shared variables in a section of their
// own, where the ELF symbol table gives each one's bounds and kernel.
#ifdef FLOWGEN_EMU_CHECK
#define __shared__ static __attribute__((section("flowgen_shared")))
#else
#define __shared__ static thread_local
#endif

// ---------------------------------------------------------------------------------------
// Thread geometry. thread_local because every OpenMP thread runs its own block; the
// fiber scheduler rewrites threadIdx whenever it resumes a thread.
struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// Vector types. g++ splits a copy of one into its fields, so the checking mode checks the
// alignment of a vector copied from or to memory in the copy itself (a misaligned vector access
// is a fault on the GPU).
#ifdef FLOWGEN_EMU_CHECK
namespace flowgen_emu {
namespace check {
void vector_access(const void* p, size_t bytes, bool write);
}  // namespace check
}  // namespace flowgen_emu
#define FLOWGEN_EMU_VECTOR_COPIES(T)                                                              \
  T() = default;                                                                                  \
  T(const T& other) {                                                                             \
    flowgen_emu::check::vector_access(&other, sizeof(T), false);                                  \
    std::memcpy(this, &other, sizeof(T));                                                         \
  }                                                                                               \
  T& operator=(const T& other) {                                                                  \
    flowgen_emu::check::vector_access(&other, sizeof(T), false);                                  \
    flowgen_emu::check::vector_access(this, sizeof(T), true);                                     \
    std::memcpy(this, &other, sizeof(T));                                                         \
    return *this;                                                                                 \
  }
struct __align__(8) float2 {
  float x, y;
  FLOWGEN_EMU_VECTOR_COPIES(float2)
  constexpr float2(float x_, float y_) : x(x_), y(y_) {}
};
struct __align__(16) float4 {
  float x, y, z, w;
  FLOWGEN_EMU_VECTOR_COPIES(float4)
  constexpr float4(float x_, float y_, float z_, float w_) : x(x_), y(y_), z(z_), w(w_) {}
};
#undef FLOWGEN_EMU_VECTOR_COPIES
#else
struct __align__(8) float2 { float x, y; };
struct __align__(16) float4 { float x, y, z, w; };
#endif
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// ---------------------------------------------------------------------------------------
// 16-bit floats: storage is the raw bits, conversions round to nearest even like the GPU,
// arithmetic goes through float (exact for + - * /: float has more than 2p+2 bits).
namespace flowgen_emu {

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Rounds away the low `shift` bits of `m` to nearest, ties to even.
inline uint32_t round_shift(uint32_t m, int shift) {
  uint32_t kept = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  return kept + (rest > half || (rest == half && (kept & 1)));
}

inline uint16_t float_to_half_bits(float f) {
  uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return sign | 0x7e00;   // NaN stays a (quiet) NaN
  if (ax >= 0x477ff000) return sign | 0x7c00;  // at or past 65520 rounds to infinity
  if (ax >= 0x38800000)                        // normal half: rebias the exponent 127 -> 15
    return sign | round_shift(ax - (112u << 23), 13);
  if (ax <= 0x33000000) return sign;           // at most 2^-25 rounds to zero
  // Subnormal half: the result counts units of 2^-24.
  int exponent = ax >> 23;
  return sign | round_shift((ax & 0x7fffff) | 0x800000, 126 - exponent);
}

inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000 | (mantissa << 13));
  if (exponent == 0) {
    float magnitude = std::ldexp(float(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);
  return uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

}  // namespace flowgen_emu

// Same shape as CUDA's types: converting constructor from float and `operator float`.
struct __half {
  uint16_t __x;
  __half() = default;  // trivial, so `__shared__ __half buf[N]` needs no TLS constructor
  __half(float f) : __x(flowgen_emu::float_to_half_bits(f)) {}
  operator float() const { return flowgen_emu::half_bits_to_float(__x); }
};
struct __nv_bfloat16 {
  uint16_t __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(flowgen_emu::float_to_bf16_bits(f)) {}
  operator float() const { return flowgen_emu::bits_float(uint32_t(__x) << 16); }
};

#define FLOWGEN_EMU_16BIT_OPS(T)                                                   \
  inline T operator+(T a, T b) { return T(float(a) + float(b)); }                 \
  inline T operator-(T a, T b) { return T(float(a) - float(b)); }                 \
  inline T operator*(T a, T b) { return T(float(a) * float(b)); }                 \
  inline T operator/(T a, T b) { return T(float(a) / float(b)); }                 \
  inline T operator-(T a) { return T(-float(a)); }                                 \
  inline T& operator+=(T& a, T b) { return a = a + b; }                            \
  inline T& operator-=(T& a, T b) { return a = a - b; }                            \
  inline T& operator*=(T& a, T b) { return a = a * b; }                            \
  inline T& operator/=(T& a, T b) { return a = a / b; }                            \
  inline bool operator==(T a, T b) { return float(a) == float(b); }                \
  inline bool operator!=(T a, T b) { return float(a) != float(b); }                \
  inline bool operator<(T a, T b) { return float(a) < float(b); }                  \
  inline bool operator<=(T a, T b) { return float(a) <= float(b); }                \
  inline bool operator>(T a, T b) { return float(a) > float(b); }                  \
  inline bool operator>=(T a, T b) { return float(a) >= float(b); }
FLOWGEN_EMU_16BIT_OPS(__half)
FLOWGEN_EMU_16BIT_OPS(__nv_bfloat16)
#undef FLOWGEN_EMU_16BIT_OPS

inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }

// ---------------------------------------------------------------------------------------
// Math. expf, logf, tanhf, erff, fmaf, ... come from <cmath>; these are CUDA-only names.
// The fast-math variants are computed exactly: the emulator is a reference, not a model
// of the GPU's approximation error.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
using std::isfinite;  // CUDA has these in the global namespace
using std::isinf;
using std::isnan;
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __saturatef(float x) { return fminf(fmaxf(x, 0.0f), 1.0f); }
// erfinv / erfinvf: Giles' single-precision approximation in double, then two Newton steps on
// erf(y) = x (the eager reference, flowgen/ops/elementwise.py, takes the same steps; from its
// ~1e-7 start they reach double precision). CUDA has both built in.
inline double erfinv(double x) {
  if (!(fabs(x) < 1.0)) return fabs(x) == 1.0 ? copysign(INFINITY, x) : NAN;
  double w = -log((1.0 - x) * (1.0 + x)), p;
  if (w < 5.0) {
    w -= 2.5;
    p = 2.81022636e-08;
    for (double c : {3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
                     -0.00417768164, 0.246640727, 1.50140941}) p = c + p * w;
  } else {
    w = sqrt(w) - 3.0;
    p = -0.000200214257;
    for (double c : {0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
                     0.00943887047, 1.00167406, 2.83297682}) p = c + p * w;
  }
  double y = p * x;
  for (int i = 0; i < 2; ++i) y -= (erf(y) - x) / (1.1283791670955126 * exp(-y * y));
  return y;
}
inline float erfinvf(float x) { return (float)erfinv((double)x); }
template <class T> inline T __ldg(const T* p) { return *p; }

// CUDA's max/min are same-type overloads (mixed int/float calls are ambiguous on the GPU too).
#define FLOWGEN_EMU_MINMAX(T)                                  \
  inline T max(T a, T b) { return a > b ? a : b; }             \
  inline T min(T a, T b) { return a < b ? a : b; }
FLOWGEN_EMU_MINMAX(int)
FLOWGEN_EMU_MINMAX(unsigned)
FLOWGEN_EMU_MINMAX(long)
FLOWGEN_EMU_MINMAX(unsigned long)
FLOWGEN_EMU_MINMAX(long long)
FLOWGEN_EMU_MINMAX(unsigned long long)
#undef FLOWGEN_EMU_MINMAX
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(double a, double b) { return fmin(a, b); }

inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { return flowgen_emu::float_bits(f); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { return flowgen_emu::bits_float(u); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }

// ---------------------------------------------------------------------------------------
// Atomics: relaxed, like CUDA's. Floating point and min/max use a compare-exchange loop.
namespace flowgen_emu {
template <class T, class F> inline T atomic_update(T* p, F f) {
  T old, desired;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  do {
    desired = f(old);
  } while (!__atomic_compare_exchange(p, &old, &desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  return old;
}
}  // namespace flowgen_emu

#define FLOWGEN_EMU_INT_ATOMICS(T)                                                            \
  inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }        \
  inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }      \
  inline T atomicMax(T* p, T v) {                                                             \
    return flowgen_emu::atomic_update(p, [v](T old) { return old > v ? old : v; });           \
  }                                                                                           \
  inline T atomicMin(T* p, T v) {                                                             \
    return flowgen_emu::atomic_update(p, [v](T old) { return old < v ? old : v; });           \
  }                                                                                           \
  inline T atomicCAS(T* p, T compare, T v) {                                                  \
    __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);   \
    return compare; /* the value found, whether or not it was swapped */                      \
  }
FLOWGEN_EMU_INT_ATOMICS(int)
FLOWGEN_EMU_INT_ATOMICS(unsigned)
FLOWGEN_EMU_INT_ATOMICS(unsigned long long)
#undef FLOWGEN_EMU_INT_ATOMICS
inline int atomicSub(int* p, int v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicSub(unsigned* p, unsigned v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
inline float atomicAdd(float* p, float v) {
  return flowgen_emu::atomic_update(p, [v](float old) { return old + v; });
}
inline double atomicAdd(double* p, double v) {
  return flowgen_emu::atomic_update(p, [v](double old) { return old + v; });
}
inline float atomicExch(float* p, float v) {
  float old;
  __atomic_exchange(p, &v, &old, __ATOMIC_RELAXED);
  return old;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ---------------------------------------------------------------------------------------
// Block execution state, one per OS thread.
namespace flowgen_emu {

#ifndef FLOWGEN_EMU_FIBER_STACK
#define FLOWGEN_EMU_FIBER_STACK (256 * 1024)  // allocated lazily by the OS: untouched pages cost nothing
#endif

// A fiber switch must be cheap: a barrier in a 256-thread block is 256 switches.
// ucontext's swapcontext makes a sigprocmask system call per switch, so on x86-64 we
// switch stacks ourselves: push the callee-saved registers, swap stack pointers, pop.
// The FP control words (MXCSR, x87 CW) are not switched: no kernel changes them, so every
// fiber of a block runs under the control words run_block_with_fibers sets once per block
// (ldmxcsr/fldcw per switch cost about a fifth of a switch). Other targets use ucontext.
#if defined(__x86_64__)
extern "C" void flowgen_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .weak flowgen_emu_switch
  .hidden flowgen_emu_switch
  .type flowgen_emu_switch, @function
flowgen_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size flowgen_emu_switch, .-flowgen_emu_switch
)");

struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context& from, Context& to) { flowgen_emu_switch(&from.sp, to.sp); }

// Lays out a stack so that the first switch to it "returns" into entry().
inline void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  void** ret_slot = reinterpret_cast<void**>(top - 16);  // 16-aligned: entry sees a call frame
  ret_slot[1] = nullptr;                                  // entry() never returns
  ret_slot[0] = reinterpret_cast<void*>(entry);
  uint64_t* frame = reinterpret_cast<uint64_t*>(ret_slot) - 6;  // the 6 callee-saved registers
  std::memset(frame, 0, 6 * sizeof(uint64_t));
  c.sp = frame;
}

// The default control words (round to nearest, no flush to zero, exceptions masked),
// which the fibers of a block run under whatever the launching thread has set.
struct DefaultFpControl {
  uint32_t saved_mxcsr;
  uint16_t saved_x87;
  DefaultFpControl() {
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(saved_mxcsr), "=m"(saved_x87));
    const uint32_t mxcsr = 0x1F80;
    const uint16_t x87 = 0x037F;
    asm volatile("ldmxcsr %0\n\tfldcw %1" : : "m"(mxcsr), "m"(x87));
  }
  ~DefaultFpControl() { asm volatile("ldmxcsr %0\n\tfldcw %1" : : "m"(saved_mxcsr), "m"(saved_x87)); }
};
#else
struct Context {
  ucontext_t uc;
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
struct DefaultFpControl {};  // ucontext fibers start with the control words of getcontext
#endif

struct Fiber {
  Context context;
  std::unique_ptr<char[]> stack;
  size_t stack_bytes = 0;
};

// The checking mode runs every kernel on fibers, those registered with SerialBlocks too, whose one
// thread keeps a whole tile of accumulators on its stack (256 KB for 256 x 256 floats).
inline size_t fiber_stack_bytes(int nthreads) {
#ifdef FLOWGEN_EMU_CHECK
  if (nthreads == 1) return size_t(16) << 20;
#endif
  (void)nthreads;
  return FLOWGEN_EMU_FIBER_STACK;
}

// Fiber t's stack starts this many bytes below the top of its allocation. The allocations
// are page-aligned, so without the offset every fiber's hot frames would sit at the same
// address modulo 4 KiB and evict one another from the L1 cache at every switch.
inline size_t stack_stagger(int t) { return size_t(t % 61) * 64; }

struct Block {
  bool fibers = false;  // false: threads run in a plain loop and must not synchronise
  int nthreads = 0;
  int current = 0;      // linear id of the thread that is running
  void (*body)(void*) = nullptr;  // runs the kernel for the current thread
  void* body_arg = nullptr;
  Context scheduler;                          // resumed once every thread has finished
  std::vector<std::unique_ptr<Fiber>> pool;   // kept across blocks and launches
  std::vector<uint3> thread_index;            // threadIdx of each linear id, set per launch
  std::vector<unsigned char> done;
  // Shuffles and votes: two slots per thread, used alternately (parity), so one warp barrier
  // per exchange suffices: a lane writes a slot again only two exchanges later, after every
  // lane has passed the barrier between, i.e. finished reading it.
  std::vector<uint64_t> exchange;
  std::vector<unsigned char> parity;
  // Warp-wide operand exchange of the tensor-core primitives (mma, ldmatrix): like
  // `exchange` but 32 bytes per slot; it shares `parity`, so the same one-barrier argument holds.
  struct alignas(16) WideSlot { unsigned char bytes[32]; };
  std::vector<WideSlot> wide_exchange;
  // cp.async: each thread's copies not yet committed, then its committed groups, oldest
  // first. A copy lands when wait_group retires its group (one legal GPU schedule; the checking
  // mode lands it at a random point between issue and wait), so a kernel that reads shared
  // memory before waiting reads stale data here too.
  struct AsyncCopy { void* dst; const void* src; int bytes, src_bytes; bool landed; };
  struct AsyncQueue { std::vector<AsyncCopy> open; std::deque<std::vector<AsyncCopy>> groups; };
  std::vector<AsyncQueue> async_copies;
  bool async_used = false;  // a thread of this block issued cp.async: clear the queues before the next
  // Warpgroup MMA (wgmma.mma_async): each thread's operations not yet committed, then its
  // committed groups, oldest first. An operation computes this thread's accumulators when
  // wgmma.wait_group retires its group (one legal GPU schedule; the checking mode computes at a
  // random point between issue and wait, in issue order): a kernel that reads the
  // accumulators before waiting reads their old values here too. `fenced`: a wgmma.fence
  // since the thread's last wait (the emulator asks for one before every batch of wgmma).
  struct WarpgroupMma {
    uint64_t a_desc, b_desc;
    float* d;
    int n, k, element_bytes;  // m64n{n}k{k}; operands of 2 (bf16, f16) or 4 (tf32) bytes
    bool scale_d, trans_a, trans_b;
    float (*decode)(uint32_t);
    bool done;  // computed (the checking mode computes at a random point before the wait retires it)
  };
  struct WgmmaQueue {
    std::vector<WarpgroupMma> open;
    std::deque<std::vector<WarpgroupMma>> groups;
    bool fenced = false;
  };
  std::vector<WgmmaQueue> wgmma;
  bool wgmma_used = false;
  struct alignas(16) Chunk { unsigned char bytes[16]; };
  std::vector<Chunk> dynamic_shared;          // sized per launch (the checking mode adds guards)
  unsigned char* dynamic_base = nullptr;      // the first byte of the launch's dynamic shared memory
  size_t dynamic_bytes = 0;
  bool registered_fibers = false;             // FLOWGEN_EMU_KERNEL(name, true): it may synchronise
};
// The block state of this OS thread, owned here and reached through `current_block`: a
// thread_local with a constructor is read through a TLS wrapper call that checks whether
// it is constructed yet, and the hot paths (every switch, shuffle and vote) read the
// block several times, so they go through the plain pointer instead.
inline thread_local Block tl_block_storage;
inline thread_local Block* current_block = nullptr;  // set by run_grid before any block runs

inline void become_thread(Block& b, int t) {
  b.current = t;
  threadIdx = b.thread_index[t];
}

// The shared-window address of the first byte of dynamic shared memory. The GPU promises 16-byte
// alignment only, so the emulator places it at 16: a kernel must align swizzled tiles itself.
constexpr uint32_t kDynamicSharedAddress = 16;

}  // namespace flowgen_emu

#ifdef FLOWGEN_EMU_CHECK
#include "flowgen_emu_check.h"
#endif

namespace flowgen_emu {

// An error in the kernel the emulator cannot go on from: the checking mode reports it (naming
// the kernel, block and thread) and fails the launch; otherwise it is printed and the process aborts.
[[noreturn]] __attribute__((format(printf, 1, 2))) inline void fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
#ifdef FLOWGEN_EMU_CHECK
  if (check::checker.active) {
    check::record(fmt, args);
    va_end(args);
    check::checker.report += ", " + check::block_name() + ", " + check::thread_name(check::checker.running->current);
    check::bail();
  }
#endif
  std::fputs("flowgen emulator: ", stderr);
  std::vfprintf(stderr, fmt, args);
  std::fputs("\n", stderr);
  va_end(args);
  std::abort();
}

// Passes control from thread `me` to the next unfinished thread of [first, first + count),
// cyclically. Round-robin order means every other participant runs up to its own next
// synchronisation point before `me` resumes, which is barrier semantics as long as all
// participants reach the same barriers (as CUDA requires). Exited threads are skipped.
inline void yield_to_next(Block& b, int me, int first, int count) {
  const int end = first + count;
  int t = me;
  for (int k = 1; k <= count; ++k) {
    if (++t == end) t = first;
    if (b.done[t]) continue;
    if (t != me) {
      b.current = t;  // a fiber starting for the first time reads its id from here
      switch_context(b.pool[me]->context, b.pool[t]->context);
      become_thread(b, me);
    }
    return;
  }
  switch_context(b.pool[me]->context, b.scheduler);  // every thread of the block has finished
}

inline void fiber_main() {
  Block& b = *current_block;
  const int t = b.current;
  become_thread(b, t);
#ifdef FLOWGEN_EMU_CHECK
  check::checker.inside = false;
  b.body(b.body_arg);
  check::thread_exit(b, t);
#else
  b.body(b.body_arg);
  b.done[t] = 1;
  yield_to_next(b, t, 0, b.nthreads);
#endif
}

inline void run_block_with_fibers(Block& b, long long linear_block) {
  const int n = b.nthreads;
  const size_t stack_bytes = fiber_stack_bytes(n);
  while (int(b.pool.size()) < n) b.pool.push_back(std::make_unique<Fiber>());
  for (int t = 0; t < n; ++t) {
    if (b.pool[t]->stack_bytes >= stack_bytes) continue;
    b.pool[t]->stack.reset(new char[stack_bytes]);
    b.pool[t]->stack_bytes = stack_bytes;
  }
  b.done.assign(n, 0);
  b.exchange.resize(2 * size_t(n));
  b.wide_exchange.resize(2 * size_t(n));
  b.parity.assign(n, 0);
  if (b.async_copies.size() < size_t(n)) b.async_copies.resize(n);
  if (b.async_used) {  // copies a kernel never waited for must not land in the next block
    for (Block::AsyncQueue& queue : b.async_copies) {
      queue.open.clear();
      queue.groups.clear();
    }
    b.async_used = false;
  }
  if (b.wgmma.size() < size_t(n)) b.wgmma.resize(n);
  if (b.wgmma_used) {  // nor may warpgroup MMAs it never waited for
    for (Block::WgmmaQueue& queue : b.wgmma) queue = Block::WgmmaQueue{};
    b.wgmma_used = false;
  }
  for (int t = 0; t < n; ++t)
    start_context(b.pool[t]->context, b.pool[t]->stack.get(), b.pool[t]->stack_bytes - stack_stagger(t),
                  fiber_main);
  DefaultFpControl fp_control;  // the fibers' control words, as on the GPU
  b.current = 0;
#ifdef FLOWGEN_EMU_CHECK
  check::begin_block(b, linear_block);
  switch_context(b.scheduler, b.pool[0]->context);
  check::end_block(b);
#else
  (void)linear_block;
  switch_context(b.scheduler, b.pool[0]->context);
#endif
}

inline Block& synchronising_block(const char* what) {
  Block& b = *current_block;
  if (!b.registered_fibers)
    fail("%s called by a kernel registered with FLOWGEN_EMU_KERNEL(name, false); register it with true", what);
  return b;
}

inline int warp_first(const Block& b) { return b.current & ~(warpSize - 1); }
inline int warp_count(const Block& b) { return std::min(warpSize, b.nthreads - warp_first(b)); }
// The lanes of the warp meet. Only __syncwarp orders their memory accesses (`orders_memory`);
// shuffles, votes, mma and ldmatrix exchange registers.
#ifdef FLOWGEN_EMU_CHECK
inline void warp_barrier(Block&, bool orders_memory = false) { check::warp_barrier(orders_memory); }
#else
inline void warp_barrier(Block& b, bool = false) { yield_to_next(b, b.current, warp_first(b), warp_count(b)); }
#endif

// This lane's slot of the exchange buffer for its next shuffle or vote (see Block::parity).
inline uint64_t* exchange_slots(Block& b) {
  const int me = b.current;
  uint64_t* slots = &b.exchange[size_t(b.parity[me]) * b.nthreads];
  b.parity[me] ^= 1;
  return slots;
}

// Every lane publishes `v`, then reads the value of lane `src` of its warp; a lane whose
// `src` is negative or names no thread gets its own value back.
template <class T> inline T warp_exchange(T v, int src) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable<T>::value,
                "warp shuffles move values of at most 8 bytes");
  Block& b = synchronising_block("a warp shuffle");
  const int me = b.current, first = warp_first(b);
  uint64_t* slots = exchange_slots(b);
  std::memcpy(&slots[me], &v, sizeof(T));
  warp_barrier(b);
  T result = v;
  if (src >= 0 && src < warpSize && first + src < b.nthreads)
    std::memcpy(&result, &slots[first + src], sizeof(T));
  return result;
}

// Bit l is set when lane l's predicate is true.
inline unsigned warp_vote(int predicate) {
  Block& b = synchronising_block("a warp vote");
  const int first = warp_first(b), count = warp_count(b);
  uint64_t* slots = exchange_slots(b);
  slots[b.current] = predicate != 0;
  warp_barrier(b);
  unsigned bits = 0;
  for (int lane = 0; lane < count; ++lane) bits |= unsigned(slots[first + lane] != 0) << lane;
  return bits;
}

inline unsigned warp_lanes() {
  int count = warp_count(*current_block);
  return count == warpSize ? ~0u : (1u << count) - 1;
}

inline int lane_id() { return current_block->current & (warpSize - 1); }

}  // namespace flowgen_emu

#ifdef FLOWGEN_EMU_CHECK
// Each __syncthreads is told its source line: the threads of a block must all reach the same one.
inline void flowgen_emu_syncthreads_at(int line) {
  flowgen_emu::synchronising_block("__syncthreads");
  flowgen_emu::check::block_barrier(line);
}
#define __syncthreads() flowgen_emu_syncthreads_at(__LINE__)
#else
inline void __syncthreads() {
  flowgen_emu::Block& b = flowgen_emu::synchronising_block("__syncthreads");
  flowgen_emu::yield_to_next(b, b.current, 0, b.nthreads);
}
#endif
inline void __syncwarp(unsigned = 0xffffffffu) {
  flowgen_emu::warp_barrier(flowgen_emu::synchronising_block("__syncwarp"), true);
}

// Lane masks are not checked: the emulator assumes, like the kernels, a converged warp.
template <class T> inline T __shfl_sync(unsigned, T v, int src_lane, int width = warpSize) {
  int lane = flowgen_emu::lane_id();
  return flowgen_emu::warp_exchange(v, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = warpSize) {
  int lane = flowgen_emu::lane_id();
  bool inside = (lane & (width - 1)) >= int(delta);
  return flowgen_emu::warp_exchange(v, inside ? lane - int(delta) : -1);
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = warpSize) {
  int lane = flowgen_emu::lane_id();
  bool inside = (lane & (width - 1)) + int(delta) < width;
  return flowgen_emu::warp_exchange(v, inside ? lane + int(delta) : -1);
}
// Like the GPU, a lane may read from an earlier width-group but not from a later one.
template <class T> inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = warpSize) {
  int lane = flowgen_emu::lane_id(), src = lane ^ lane_mask;
  bool inside = src < (lane & ~(width - 1)) + width;
  return flowgen_emu::warp_exchange(v, inside ? src : -1);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return flowgen_emu::warp_vote(predicate) & mask;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
  unsigned voters = mask & flowgen_emu::warp_lanes();
  return (__ballot_sync(mask, predicate) & voters) == voters;
}

// ---------------------------------------------------------------------------------------
// Tensor-core primitives: the emulator's versions of the device functions that
// flowgen_cuda_prelude.h writes in inline PTX (same names, same per-lane fragments).
// Fragment layouts follow the PTX ISA, "Warp Level Matrix Multiply-Accumulate Instructions":
// groupID = lane / 4, threadID_in_group = lane % 4, and a .b32 register holding two 16-bit
// elements keeps the lower-indexed one in its low half.
namespace flowgen_emu {

// Every lane of the warp publishes `n` (<= 32) bytes; the result points at lane 0's slot.
inline const Block::WideSlot* warp_publish(const void* data, size_t n) {
  Block& b = synchronising_block("a tensor-core primitive (mma, ldmatrix)");
  const int me = b.current, first = warp_first(b);
  Block::WideSlot* slots = &b.wide_exchange[size_t(b.parity[me]) * b.nthreads];
  b.parity[me] ^= 1;
  std::memcpy(slots[me].bytes, data, n);
  warp_barrier(b);
  if (warp_count(b) != warpSize) fail("mma/ldmatrix need a full warp of 32 threads");
  return &slots[first];
}

inline float bf16_bits_to_float(uint32_t bits) { return bits_float(bits << 16); }
// Element `which` (0: low half, 1: high half) of a register holding two 16-bit values.
inline uint32_t half_of(uint32_t reg, int which) { return (reg >> (16 * which)) & 0xffffu; }

struct MmaOperands { uint32_t a[4], b[2]; };

inline MmaOperands operands_of(const Block::WideSlot* lanes, int lane) {
  MmaOperands o;
  std::memcpy(&o, lanes[lane].bytes, sizeof o);
  return o;
}

// D = A (16 x K, row) * B (K x 8, col) + D for K = 16 (16-bit inputs) or 8 (tf32), fp32
// accumulation. Products of 16-bit or tf32 values are exact in float; each output sums its
// k terms in increasing k onto the accumulator.
template <int K, class Element>
inline void mma_m16n8(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2], Element element) {
  MmaOperands mine;
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  const Block::WideSlot* lanes = warp_publish(&mine, sizeof mine);
  const int lane = lane_id(), group = lane / 4, in_group = lane % 4;
  for (int i = 0; i < 4; ++i) {  // C/D: row groupID (+8 for c2, c3), col 2 * threadID_in_group + (i & 1)
    const int row = group + 8 * (i / 2), col = 2 * in_group + (i % 2);
    float sum = acc[i];
    for (int k = 0; k < K; ++k) sum += element.a(lanes, row, k) * element.b(lanes, k, col);
    acc[i] = sum;
  }
}

// m16n8k16 .f16/.bf16: A element (row, k) is in lane 4 * (row % 8) + (k % 8) / 2, register
// (row >= 8) + 2 * (k >= 8); B element (k, col) in lane 4 * col + (k % 8) / 2, register (k >= 8).
template <float (*Decode)(uint32_t)> struct Elements16 {
  float a(const Block::WideSlot* lanes, int row, int k) const {
    MmaOperands o = operands_of(lanes, 4 * (row % 8) + (k % 8) / 2);
    return Decode(half_of(o.a[(row >= 8) + 2 * (k >= 8)], k % 2));
  }
  float b(const Block::WideSlot* lanes, int k, int col) const {
    MmaOperands o = operands_of(lanes, 4 * col + (k % 8) / 2);
    return Decode(half_of(o.b[k >= 8], k % 2));
  }
};

inline float half_register_to_float(uint32_t bits) { return half_bits_to_float(uint16_t(bits)); }

// The tensor core reads the top 19 bits of a .tf32 operand (sign, exponent, 10 mantissa bits).
inline float tf32_operand(uint32_t bits) { return bits_float(bits & 0xffffe000u); }

// m16n8k8 .tf32: A element (row, k) is in lane 4 * (row % 8) + k % 4, register
// (row >= 8) + 2 * (k >= 4); B element (k, col) in lane 4 * col + k % 4, register (k >= 4).
struct ElementsTf32 {
  float a(const Block::WideSlot* lanes, int row, int k) const {
    return tf32_operand(operands_of(lanes, 4 * (row % 8) + k % 4).a[(row >= 8) + 2 * (k >= 4)]);
  }
  float b(const Block::WideSlot* lanes, int k, int col) const {
    return tf32_operand(operands_of(lanes, 4 * col + k % 4).b[k >= 4]);
  }
};

// Column c (16 bits) of the row at `row`.
FLOWGEN_EMU_UNCHECKED inline uint32_t row_element(const void* row, int c) {
  uint16_t bits;
  std::memcpy(&bits, static_cast<const unsigned char*>(row) + 2 * c, 2);
  return bits;
}

// ldmatrix .m8n8 .b16: lanes 8j..8j+7 give the row addresses of matrix j (16 bytes each);
// register j of lane l then holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix j,
// or with .trans column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1.
template <int Matrices, bool Transposed> inline void ldmatrix(unsigned* regs, const void* row) {
#ifdef FLOWGEN_EMU_CHECK
  synchronising_block("ldmatrix");
  check::ldmatrix_row(row, Matrices);
#endif
  const Block::WideSlot* lanes = warp_publish(&row, sizeof row);
  const int lane = lane_id(), group = lane / 4, in_group = lane % 4;
  auto element = [&](int matrix, int r, int c) {
    const void* address;
    std::memcpy(&address, lanes[8 * matrix + r].bytes, sizeof address);
    return row_element(address, c);
  };
  for (int j = 0; j < Matrices; ++j) {
    regs[j] = Transposed ? element(j, 2 * in_group, group) | element(j, 2 * in_group + 1, group) << 16
                         : element(j, group, 2 * in_group) | element(j, group, 2 * in_group + 1) << 16;
  }
}

FLOWGEN_EMU_UNCHECKED inline void land(Block::AsyncCopy& c) {
  std::memcpy(c.dst, c.src, size_t(c.src_bytes));
  std::memset(static_cast<unsigned char*>(c.dst) + c.src_bytes, 0, size_t(c.bytes - c.src_bytes));
  c.landed = true;
}

inline void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  Block& b = synchronising_block("cp.async");
  if (src_bytes < 0 || src_bytes > bytes) fail("cp.async src-size %d outside [0, %d]", src_bytes, bytes);
#ifdef FLOWGEN_EMU_CHECK
  check::cp_async_issue(dst, src, bytes);
#endif
  b.async_copies[b.current].open.push_back({dst, src, bytes, src_bytes, false});
  b.async_used = true;
#ifdef FLOWGEN_EMU_CHECK
  if (check::coin() && check::coin()) land(b.async_copies[b.current].open.back());  // lands at once
#endif
}

// Lands every committed group but the newest `pending` ones.
inline void cp_async_retire(int pending) {
  Block& b = synchronising_block("cp.async.wait_group");
  auto& groups = b.async_copies[b.current].groups;
  while (int(groups.size()) > pending) {
    for (Block::AsyncCopy& c : groups.front()) {
      if (!c.landed) land(c);
#ifdef FLOWGEN_EMU_CHECK
      check::cp_async_retired(c.dst, c.bytes);
#endif
    }
    groups.pop_front();
  }
}

}  // namespace flowgen_emu

inline void mma_m16n8k16_bf16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  flowgen_emu::mma_m16n8<16>(acc, a, b, flowgen_emu::Elements16<flowgen_emu::bf16_bits_to_float>{});
}
inline void mma_m16n8k16_f16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  flowgen_emu::mma_m16n8<16>(acc, a, b, flowgen_emu::Elements16<flowgen_emu::half_register_to_float>{});
}
inline void mma_m16n8k8_tf32(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  flowgen_emu::mma_m16n8<8>(acc, a, b, flowgen_emu::ElementsTf32{});
}

// cvt.rna.tf32.f32: round to 10 mantissa bits, to nearest with ties away from zero.
inline unsigned float_to_tf32(float x) {
  const uint32_t bits = flowgen_emu::float_bits(x);
  if ((bits & 0x7fffffffu) >= 0x7f800000u) return bits;  // inf and NaN pass through
  return (bits + 0x1000u) & 0xffffe000u;
}

inline void ldmatrix_x1(unsigned (&r)[1], const void* row) { flowgen_emu::ldmatrix<1, false>(r, row); }
inline void ldmatrix_x2(unsigned (&r)[2], const void* row) { flowgen_emu::ldmatrix<2, false>(r, row); }
inline void ldmatrix_x4(unsigned (&r)[4], const void* row) { flowgen_emu::ldmatrix<4, false>(r, row); }
inline void ldmatrix_x1_trans(unsigned (&r)[1], const void* row) { flowgen_emu::ldmatrix<1, true>(r, row); }
inline void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) { flowgen_emu::ldmatrix<2, true>(r, row); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) { flowgen_emu::ldmatrix<4, true>(r, row); }

template <int Bytes> inline void cp_async_ca(void* smem, const void* gmem, int src_bytes) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async.ca copies 4, 8 or 16 bytes");
  flowgen_emu::cp_async(smem, gmem, Bytes, src_bytes);
}
inline void cp_async_cg(void* smem, const void* gmem, int src_bytes) {
  flowgen_emu::cp_async(smem, gmem, 16, src_bytes);
}
inline void cp_async_commit() {
  flowgen_emu::Block& b = flowgen_emu::synchronising_block("cp.async.commit_group");
  auto& queue = b.async_copies[b.current];
  queue.groups.push_back(std::move(queue.open));
  queue.open.clear();
}
template <int N> inline void cp_async_wait_group() { flowgen_emu::cp_async_retire(N); }

// ---------------------------------------------------------------------------------------
// Hopper warpgroup MMA: the emulator's versions of the sm_90a functions of
// flowgen_cuda_prelude.h. PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate
// Instructions": matrix descriptors, the canonical shared-memory layouts of K-major and
// M/N-major operands with their swizzles, and the accumulator fragment of m64nNk16.
#define WGMMA_INTERLEAVE 0
#define WGMMA_SWIZZLE_128B 1
#define WGMMA_SWIZZLE_64B 2
#define WGMMA_SWIZZLE_32B 3

namespace flowgen_emu {

inline uint32_t shared_window_address(const void* p) {
  const Block& b = *current_block;
  const auto* q = static_cast<const unsigned char*>(p);
  if (q < b.dynamic_base || q > b.dynamic_base + b.dynamic_bytes)
    fail("shared_address of a pointer outside dynamic shared memory (only FLOWGEN_DYN_SHARED memory has "
         "shared-window addresses here)");
  return uint32_t(q - b.dynamic_base) + kDynamicSharedAddress;
}

FLOWGEN_EMU_UNCHECKED inline const unsigned char* shared_window_pointer(uint32_t address, int bytes) {
  const Block& b = *current_block;
  if (address < kDynamicSharedAddress || address + bytes > kDynamicSharedAddress + b.dynamic_bytes)
    fail("wgmma operand address %u outside dynamic shared memory [%u, %zu)", address, kDynamicSharedAddress,
         kDynamicSharedAddress + b.dynamic_bytes);
  return b.dynamic_base + (address - kDynamicSharedAddress);
}

// A decoded matrix descriptor (byte values).
struct MatrixDescriptor {
  uint32_t start, leading, stride;
  int swizzle_chunks;  // W: 16-byte chunks per swizzled row (8: 128B, 4: 64B, 2: 32B); 1: interleave
};

inline MatrixDescriptor decode_descriptor(uint64_t desc) {
  if ((desc >> 49 & 7) != 0)
    fail("wgmma descriptor %#llx with a nonzero base offset (unaligned swizzle pattern) is not emulated",
         (unsigned long long)desc);
  static const int chunks[4] = {1, 8, 4, 2};  // swizzle mode 0: interleave, 1: 128B, 2: 64B, 3: 32B
  return {uint32_t(desc & 0x3FFF) << 4, uint32_t(desc >> 16 & 0x3FFF) << 4, uint32_t(desc >> 32 & 0x3FFF) << 4,
          chunks[desc >> 62]};
}

// Shared-window address of element (mn, k), k < 32 bytes' worth (16 16-bit or 8 tf32 elements),
// of an operand of `bytes`-byte elements in the canonical layout of `d` (cute's GMMA layouts in
// elements, T per 16 bytes: 8 for 16-bit, 4 for tf32; W = d.swizzle_chunks):
//   K-major,  interleave: ((8,m),(T,2)):((T,SBO),(1,LBO))
//   K-major,  swizzled:   ((8,m),(T,2)):((W T,SBO),(1,T))         (LBO unused)
//   MN-major, interleave: ((T,1,m),(8,2)):((1,T,SBO),(T,LBO))      (16-bit only)
//   MN-major, swizzled:   ((T,W,m),(8,2)):((1,T,LBO),(W T,SBO))    (16-bit only)
// then the swizzle XORs address bits [4, 4 + log2 W) with bits [7, 7 + log2 W): the 16-byte
// chunk c of 128-byte row r (of a 1024-byte aligned 128B pattern) lands at chunk c ^ (r % 8).
inline uint32_t canonical_address(const MatrixDescriptor& d, bool mn_major, int mn, int k, int bytes) {
  const int W = d.swizzle_chunks, T = 16 / bytes;
  uint32_t offset;
  if (!mn_major && W == 1)
    offset = (mn % 8) * 16 + (mn / 8) * d.stride + (k / T) * d.leading + (k % T) * bytes;
  else if (!mn_major)
    offset = (mn % 8) * W * 16 + (mn / 8) * d.stride + (k / T) * 16 + (k % T) * bytes;
  else if (W == 1)
    offset = (mn % 8) * 2 + (mn / 8) * d.stride + (k % 8) * 16 + (k / 8) * d.leading;
  else
    offset = (mn % (8 * W)) * 2 + (mn / (8 * W)) * d.leading + (k % 8) * W * 16 + (k / 8) * d.stride;
  const uint32_t address = d.start + offset;
  return W == 1 ? address : address ^ ((address >> 7 & uint32_t(W - 1)) << 4);
}

FLOWGEN_EMU_UNCHECKED inline float operand_element(const MatrixDescriptor& d, bool mn_major, int mn, int k, int bytes,
                             float (*decode)(uint32_t)) {
  uint32_t bits = 0;  // the element's bytes, little-endian as on the GPU
  std::memcpy(&bits, shared_window_pointer(canonical_address(d, mn_major, mn, k, bytes), bytes), size_t(bytes));
  return decode(bits);
}

// This thread's part of D (64 x n) = A (64 x k) * B (k x n) + (scale_d ? D : 0), k = 16 (16-bit
// operands) or 8 (tf32): register r of lane l in warp w of the warpgroup is
// D(16 w + l / 4 + 8 ((r / 2) % 2), 8 (r / 4) + 2 (l % 4) + r % 2). Products of 16-bit or tf32
// values are exact in float; each output adds its k terms in increasing k (as mma.sync does here).
FLOWGEN_EMU_UNCHECKED inline void run_wgmma(Block::WarpgroupMma& op, int thread) {
  const MatrixDescriptor a = decode_descriptor(op.a_desc), b = decode_descriptor(op.b_desc);
  const int warp = thread % 128 / 32, lane = thread % 32;
  float a_rows[2][16], b_cols[64][16];  // the thread's 2 rows of A and n / 4 columns of B
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < op.k; ++k)
      a_rows[h][k] = operand_element(a, op.trans_a, 16 * warp + lane / 4 + 8 * h, k, op.element_bytes, op.decode);
  for (int j = 0; j < op.n / 4; ++j)
    for (int k = 0; k < op.k; ++k)
      b_cols[j][k] = operand_element(b, op.trans_b, 8 * (j / 2) + 2 * (lane % 4) + j % 2, k, op.element_bytes,
                                     op.decode);
  for (int r = 0; r < op.n / 2; ++r) {
    const float* row = a_rows[r / 2 % 2];
    const float* col = b_cols[2 * (r / 4) + r % 2];
    float sum = op.scale_d ? op.d[r] : 0.0f;
    for (int k = 0; k < op.k; ++k) sum += row[k] * col[k];
    op.d[r] = sum;
  }
  op.done = true;
}

#ifdef FLOWGEN_EMU_CHECK
// The shared-memory bytes the running thread's part of `op` reads (its 2 rows of A and n / 4
// columns of B): `issue` checks and marks them in flight, else they are retired.
inline void wgmma_operands(const Block::WarpgroupMma& op, bool issue) {
  const MatrixDescriptor a = decode_descriptor(op.a_desc), b = decode_descriptor(op.b_desc);
  const int thread = current_block->current, warp = thread % 128 / 32, lane = thread % 32;
  auto visit = [&](const MatrixDescriptor& d, bool mn_major, int mn) {
    for (int k = 0; k < op.k; ++k) {
      const uint32_t address = canonical_address(d, mn_major, mn, k, op.element_bytes);
      const unsigned char* p = shared_window_pointer(address, op.element_bytes);
      if (issue) check::wgmma_operand_issue(p, op.element_bytes);
      else check::wgmma_operand_retired(p, op.element_bytes);
    }
  };
  for (int h = 0; h < 2; ++h) visit(a, op.trans_a, 16 * warp + lane / 4 + 8 * h);
  for (int j = 0; j < op.n / 4; ++j) visit(b, op.trans_b, 8 * (j / 2) + 2 * (lane % 4) + j % 2);
}
#endif

template <int N, int K, int TransA, int TransB>
inline void wgmma_issue(float* d, uint64_t a_desc, uint64_t b_desc, int scale_d, float (*decode)(uint32_t)) {
  static_assert(N % 8 == 0 && N <= 256, "m64nNk: N a multiple of 8, at most 256");
  static_assert(K == 16 || (K == 8 && TransA == 0 && TransB == 0), "k16 (16-bit) or k8 (tf32, K-major only)");
  Block& b = synchronising_block("wgmma.mma_async");
  if (b.nthreads % 128 != 0) fail("wgmma needs whole warpgroups (blocks of 128 k threads), got %d", b.nthreads);
  Block::WgmmaQueue& queue = b.wgmma[b.current];
  if (!queue.fenced)
    fail("wgmma.mma_async without a wgmma.fence before it (one is needed before the first wgmma and after "
         "registers it uses were touched)");
  Block::WarpgroupMma op{a_desc, b_desc, d,      N,      K,    K == 16 ? 2 : 4, scale_d != 0, TransA != 0,
                         TransB != 0, decode, false};
#ifdef FLOWGEN_EMU_CHECK
  check::wgmma_signature({a_desc, b_desc, N, K, scale_d != 0, TransA, TransB, b.current});
  wgmma_operands(op, true);
#endif
  queue.open.push_back(op);
  b.wgmma_used = true;
#ifdef FLOWGEN_EMU_CHECK
  check::track_accumulators(b);
  bool earlier_done = true;   // the MMAs of a thread complete in order
  for (const auto& group : queue.groups)
    for (const auto& earlier : group) earlier_done = earlier_done && earlier.done;
  for (size_t i = 0; i + 1 < queue.open.size(); ++i) earlier_done = earlier_done && queue.open[i].done;
  if (earlier_done && check::coin() && check::coin()) run_wgmma(queue.open.back(), b.current);  // runs at once
#endif
}

}  // namespace flowgen_emu

inline unsigned shared_address(const void* p) { return flowgen_emu::shared_window_address(p); }

inline unsigned long long wgmma_descriptor(const void* tile, unsigned leading_bytes, unsigned stride_bytes,
                                           int swizzle) {
  return (unsigned long long)((shared_address(tile) & 0x3FFFF) >> 4) |
         (unsigned long long)((leading_bytes & 0x3FFFF) >> 4) << 16 |
         (unsigned long long)((stride_bytes & 0x3FFFF) >> 4) << 32 | (unsigned long long)swizzle << 62;
}

inline void wgmma_fence() {
  flowgen_emu::Block& b = flowgen_emu::synchronising_block("wgmma.fence");
  b.wgmma[b.current].fenced = true;
}
inline void wgmma_commit_group() {
  flowgen_emu::Block& b = flowgen_emu::synchronising_block("wgmma.commit_group");
  auto& queue = b.wgmma[b.current];
  queue.groups.push_back(std::move(queue.open));
  queue.open.clear();
}
// Computes every committed group but the newest N, oldest first.
template <int N> inline void wgmma_wait_group() {
  flowgen_emu::Block& b = flowgen_emu::synchronising_block("wgmma.wait_group");
  auto& queue = b.wgmma[b.current];
  while (int(queue.groups.size()) > N) {
    for (auto& op : queue.groups.front()) {
      if (!op.done) flowgen_emu::run_wgmma(op, b.current);
#ifdef FLOWGEN_EMU_CHECK
      flowgen_emu::wgmma_operands(op, false);
#endif
    }
    queue.groups.pop_front();
  }
  queue.fenced = false;
#ifdef FLOWGEN_EMU_CHECK
  flowgen_emu::check::track_accumulators(b);
#endif
}
// The accumulators live in memory here (the pending MMAs hold their address): nothing to pin.
template <int N> inline void wgmma_fence_accumulators(float (&)[N]) {}
// The emulator has one memory proxy: shared-memory writes are visible to wgmma once the
// barrier after them has passed. The checking mode asks for the fence all the same: it counts
// each thread's fences, and a wgmma may read a byte only if its writer fenced after writing it.
#ifdef FLOWGEN_EMU_CHECK
inline void fence_proxy_async_shared() { flowgen_emu::check::proxy_fence(); }
#else
inline void fence_proxy_async_shared() {}
#endif

#define FLOWGEN_EMU_WGMMA(fname, N, K, decode)                                                           \
  template <int TransA, int TransB>                                                                    \
  inline void fname(float (&d)[N / 2], unsigned long long a_desc, unsigned long long b_desc, int scale_d) { \
    flowgen_emu::wgmma_issue<N, K, TransA, TransB>(d, a_desc, b_desc, scale_d, decode);                   \
  }
FLOWGEN_EMU_WGMMA(wgmma_m64n64k16_bf16, 64, 16, flowgen_emu::bf16_bits_to_float)
FLOWGEN_EMU_WGMMA(wgmma_m64n64k16_f16, 64, 16, flowgen_emu::half_register_to_float)
FLOWGEN_EMU_WGMMA(wgmma_m64n128k16_bf16, 128, 16, flowgen_emu::bf16_bits_to_float)
FLOWGEN_EMU_WGMMA(wgmma_m64n128k16_f16, 128, 16, flowgen_emu::half_register_to_float)
FLOWGEN_EMU_WGMMA(wgmma_m64n256k16_bf16, 256, 16, flowgen_emu::bf16_bits_to_float)
FLOWGEN_EMU_WGMMA(wgmma_m64n256k16_f16, 256, 16, flowgen_emu::half_register_to_float)
// .tf32: the tensor core reads the top 19 bits of each 4-byte operand, as mma.sync's tf32 does here.
FLOWGEN_EMU_WGMMA(wgmma_m64n64k8_tf32, 64, 8, flowgen_emu::tf32_operand)
FLOWGEN_EMU_WGMMA(wgmma_m64n128k8_tf32, 128, 8, flowgen_emu::tf32_operand)
FLOWGEN_EMU_WGMMA(wgmma_m64n256k8_tf32, 256, 8, flowgen_emu::tf32_operand)
#undef FLOWGEN_EMU_WGMMA

#ifdef FLOWGEN_EMU_CHECK
namespace flowgen_emu {
namespace check {
// Thread `t` runs again: each of its copies in flight lands now with probability 1/2, and its
// oldest MMAs not yet computed run now, each with probability 1/2 (a thread's MMAs complete in order).
FLOWGEN_EMU_QUIET inline void land_some(Block& b, int t) {
  if (b.async_used) {
    Block::AsyncQueue& copies = b.async_copies[t];
    for (size_t g = 0; g <= copies.groups.size(); ++g)
      for (Block::AsyncCopy& copy : g < copies.groups.size() ? copies.groups[g] : copies.open)
        if (!copy.landed && coin()) land(copy);
  }
  if (b.wgmma_used) {
    Block::WgmmaQueue& mmas = b.wgmma[t];
    for (size_t g = 0; g <= mmas.groups.size(); ++g)
      for (Block::WarpgroupMma& op : g < mmas.groups.size() ? mmas.groups[g] : mmas.open) {
        if (op.done) continue;
        if (!coin()) return;
        run_wgmma(op, t);
      }
  }
}
}  // namespace check
}  // namespace flowgen_emu
#endif

// ---------------------------------------------------------------------------------------
// Dynamic shared memory: one 16-byte-aligned buffer per OS thread, sized at launch.
#define FLOWGEN_DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(::flowgen_emu::current_block->dynamic_base)

// ---------------------------------------------------------------------------------------
// Launching.
namespace flowgen_emu {

// The second argument of FLOWGEN_EMU_KERNEL for kernels whose blocks are one thread each, every
// one a serial job of `work` multiply-adds: no fibers; the blocks spread over the cores when
// there are at least 2^22 multiply-adds in all (about a millisecond on one core), so that waking
// the OpenMP team, or waiting for a descheduled member on a busy machine, costs little beside it.
struct SerialBlocks {
  long long work;
};

// This OS thread's block state for a launch. `guard`: bytes kept free on either side of
// dynamic shared memory (the checking mode reports accesses that land there).
inline Block& prepare_block(const unsigned* grid, const unsigned* block, size_t dynamic_shared_bytes, bool fibers,
                            bool registered_fibers, void (*body)(void*), void* body_arg, size_t guard) {
  const int nthreads = int(block[0] * block[1] * block[2]);
  gridDim = dim3(grid[0], grid[1], grid[2]);
  blockDim = dim3(block[0], block[1], block[2]);
  Block& b = tl_block_storage;
  current_block = &b;
  b.fibers = fibers;
  b.registered_fibers = registered_fibers;
  b.nthreads = nthreads;
  b.body = body;
  b.body_arg = body_arg;
  b.dynamic_shared.resize((dynamic_shared_bytes + 2 * guard + sizeof(Block::Chunk) - 1) / sizeof(Block::Chunk));
  b.dynamic_base = reinterpret_cast<unsigned char*>(b.dynamic_shared.data()) + guard;
  b.dynamic_bytes = dynamic_shared_bytes;
  if (fibers) {
    b.thread_index.resize(nthreads);
    for (int t = 0; t < nthreads; ++t)
      b.thread_index[t] = {t % block[0], t / block[0] % block[1], t / (block[0] * block[1])};
  }
  return b;
}

inline dim3 block_index(long long i, const unsigned* grid) {
  return dim3(unsigned(i % grid[0]), unsigned(i / grid[0] % grid[1]), unsigned(i / ((long long)grid[0] * grid[1])));
}

#ifdef FLOWGEN_EMU_CHECK
// The checking mode: one block at a time on the calling thread, every thread a fiber, until the
// first report.
inline void run_grid(const char* kernel, const unsigned* grid, const unsigned* block, size_t dynamic_shared_bytes,
                     bool fibers, void (*body)(void*), void* body_arg, bool = false) {
  check::Checker& c = check::checker;
  std::lock_guard<std::mutex> one_launch_at_a_time(c.launching);
  const long long nblocks = (long long)grid[0] * grid[1] * grid[2];
  if (nblocks > 0 && block[0] * block[1] * block[2] > 0 && check::begin_launch(kernel, grid, block, dynamic_shared_bytes)) {
    Block& b = prepare_block(grid, block, dynamic_shared_bytes, true, fibers, body, body_arg, check::kDynamicGuard);
    for (long long i = 0; i < nblocks && !c.failed; ++i) {
      const dim3 index = block_index(i, grid);
      blockIdx = {index.x, index.y, index.z};
      run_block_with_fibers(b, i);
    }
    b.fibers = false;
  }
  check::end_launch();
}
#else
inline void run_grid(const char*, const unsigned* grid, const unsigned* block, size_t dynamic_shared_bytes,
                     bool fibers, void (*body)(void*), void* body_arg, bool heavy_blocks = false) {
  const long long nblocks = (long long)grid[0] * grid[1] * grid[2];
  const int nthreads = int(block[0] * block[1] * block[2]);
  if (nblocks == 0 || nthreads == 0) return;
  // Small launches run on the calling thread: waking the OpenMP team costs more than the
  // work, and on a busy machine a descheduled team member stalls the whole launch.
  const bool parallel = nblocks > 1 && (heavy_blocks || nblocks * nthreads >= (1 << 16));
#pragma omp parallel if (parallel)
  {
    Block& b = prepare_block(grid, block, dynamic_shared_bytes, fibers, fibers, body, body_arg, 0);
#pragma omp for schedule(dynamic)
    for (long long i = 0; i < nblocks; ++i) {
      const dim3 index = block_index(i, grid);
      blockIdx = {index.x, index.y, index.z};
      if (fibers) {
        run_block_with_fibers(b, i);
      } else {
        for (unsigned z = 0; z < block[2]; ++z)
          for (unsigned y = 0; y < block[1]; ++y)
            for (unsigned x = 0; x < block[0]; ++x) {
              threadIdx = {x, y, z};
              body(body_arg);
            }
      }
    }
    b.fibers = false;
  }
}
#endif

// `args` holds one pointer per kernel parameter, like cuLaunchKernel's kernelParams; the
// kernel's own signature says what each pointer points to. No std::tuple of the values: g++
// needs about a minute to instantiate one for a multi-tensor update's ~150 parameters.
template <class... Params, std::size_t... I>
void call_with_args(void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
  (void)args;  // unused for kernels without parameters
  kernel(*static_cast<std::decay_t<Params>*>(args[I])...);
}

template <class... Params>
void launch(void (*kernel)(Params...), const char* name, const unsigned* grid, const unsigned* block,
            size_t dynamic_shared_bytes, void** args, bool fibers) {
  auto call = [&] { call_with_args(kernel, args, std::index_sequence_for<Params...>{}); };
  run_grid(name, grid, block, dynamic_shared_bytes, fibers,
           [](void* f) { (*static_cast<decltype(call)*>(f))(); }, &call);
}

template <class... Params>
void launch(void (*kernel)(Params...), const char* name, const unsigned* grid, const unsigned* block,
            size_t dynamic_shared_bytes, void** args, SerialBlocks serial) {
  auto call = [&] { call_with_args(kernel, args, std::index_sequence_for<Params...>{}); };
  const long long nblocks = (long long)grid[0] * grid[1] * grid[2];
  run_grid(name, grid, block, dynamic_shared_bytes, false,
           [](void* f) { (*static_cast<decltype(call)*>(f))(); }, &call, nblocks * serial.work >= (1LL << 22));
}

}  // namespace flowgen_emu

// needs_fibers: true when the kernel uses __syncthreads, __syncwarp, shuffles or votes.
#define FLOWGEN_EMU_KERNEL(kname, needs_fibers)                                              \
  extern "C" __attribute__((visibility("default"))) void flowgen_launch_##kname(             \
      const unsigned* grid3, const unsigned* block3, size_t dyn_smem_bytes, void** args) {    \
    ::flowgen_emu::launch(&kname, #kname, grid3, block3, dyn_smem_bytes, args, needs_fibers); \
  }

// A step's launches in one call (runtime/executor.py): entry points with their grids and
// arguments, run in order. Called from Python one by one, each launch costs about a microsecond
// of ctypes, as much as a small native kernel. Weak: every chunk of a library defines it.
struct FlowgenLaunch {
  void (*launch)(const unsigned* grid3, const unsigned* block3, size_t dyn_smem_bytes, void** args);
  unsigned grid[3];
  unsigned block[3];
  size_t dyn_smem_bytes;
  void** args;
};

extern "C" __attribute__((weak, visibility("default"))) void flowgen_run_launches(const FlowgenLaunch* launches,
                                                                                  int count) {
  for (int i = 0; i < count; ++i)
    launches[i].launch(launches[i].grid, launches[i].block, launches[i].dyn_smem_bytes, launches[i].args);
}
