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
