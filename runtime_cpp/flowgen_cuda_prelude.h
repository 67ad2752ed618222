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
