// flowgen_cpu.h — what the cpu target's native kernels (flowgen/codegen/cpu/) share: float32
// GEMMs through OpenBLAS (the scipy-openblas32 wheel's library, NumPy's own BLAS build), the
// im2col / col2im copies of convolutions, the Philox stream drawn a block at a time and
// attention's dot products, their loops spread over flowgen_cpu_pool.h's threads; the loops' float
// exp, erf, erfc and tanh are flowgen_cpu_math.h's.
//
// A native kernel is written like an emulated one, `extern "C" __global__ void k(...)` followed
// by `FLOWGEN_EMU_KERNEL(k, flowgen_cpu::Native{})`, so it lives in the same kernels.cu, library
// and launch list; launched with a 1x1x1 grid, its body runs once on the calling thread, which
// hands loops to the pool (`parallel_for`).
//
// Threads: one pool (flowgen_cpu_pool.h). OpenBLAS runs single-threaded inside it (set when the
// library loads): a GEMM large enough to share is split into column (or row) slices, one BLAS
// call per piece, so BLAS's own threads never compete with the pool for the cores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "flowgen_cpu_math.h"
#include "flowgen_cpu_pool.h"
#include "flowgen_philox.h"

// The two entry points used, as scipy-openblas32's cblas.h declares them (symbols prefixed
// `scipy_`, 32-bit integers).
extern "C" {
enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };
void scipy_cblas_sgemm(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE trans_a, enum CBLAS_TRANSPOSE trans_b, int M,
                       int N, int K, float alpha, const float* A, int lda, const float* B, int ldb, float beta,
                       float* C, int ldc);
void scipy_openblas_set_num_threads(int num_threads);
}

namespace flowgen_cpu {

// The tag of FLOWGEN_EMU_KERNEL's second argument for native kernels.
struct Native {};

// OpenBLAS single-threaded in every library holding a native kernel, before any kernel runs.
inline const bool blas_single_threaded = (scipy_openblas_set_num_threads(1), true);

// A piece of a parallel loop holds at least this many multiply-adds of a GEMM, or elements of a
// pass over memory: less is not worth handing to another thread (waking a helper and waiting for
// its piece cost microseconds, more on a loaded machine).
constexpr long long kParallelWork = 1LL << 17;
// Items per piece of a loop whose items take `each` units of `work` each; an item with nothing to
// do (an empty reduction's output, a GEMM over K = 0) counts as one, and g++ sees no division by 0.
constexpr long long per_piece(long long work, long long each) { return work / (each > 0 ? each : 1) + 1; }
constexpr long long kParallelElements = 1LL << 15;
// Elements per piece of a loop whose lines call a costly function (exp, erf, a Philox draw, ...):
// tens of microseconds of work.
constexpr long long kParallelCostly = 1LL << 13;
// (query, key) pairs per piece of attention's row loops (an exp, two dot products and a Philox
// word each, about 10 ns).
constexpr long long kParallelPairs = 1LL << 12;
// Multiply-adds per piece of one GEMM split over the pool: each piece is a BLAS call that packs
// its operands again, so a GEMM is cut into few (about 4 us of work each; 1 << 21 left ResNet-18's
// batch-1 convs on one thread: 5.7 ms a step against 3.2).
constexpr long long kGemmPieceWork = 1LL << 19;

// C[M, N] = op(A) @ op(B) + beta * C, all row-major with leading dimensions lda, ldb, ldc; op
// transposes where asked. Large products are split along N (or M when it is the larger) into
// slices of whole 16-column blocks, one single-threaded BLAS call per piece of the pool's loop.
inline void sgemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B,
                  int ldb, float* C, int ldc, float beta = 0.0f) {
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
  const bool split_n = N >= M;
  const int extent = split_n ? N : M, other = split_n ? M : N;
  const long long blocks = (extent + 15) / 16;
  const long long block_work = 16LL * other * std::max(K, 1);
  parallel_for(blocks, (kGemmPieceWork + block_work - 1) / block_work, [&](long long b0, long long b1) {
    const int first = (int)(b0 * 16), last = std::min(extent, (int)(b1 * 16));
    if (split_n) {  // columns [first, last) of B and C
      const float* b = trans_b ? B + (long long)first * ldb : B + first;
      scipy_cblas_sgemm(CblasRowMajor, ta, tb, M, last - first, K, 1.0f, A, lda, b, ldb, beta, C + first, ldc);
    } else {        // rows [first, last) of A and C
      const float* a = trans_a ? A + first : A + (long long)first * lda;
      scipy_cblas_sgemm(CblasRowMajor, ta, tb, last - first, N, K, 1.0f, a, lda, B, ldb, beta,
                        C + (long long)first * ldc, ldc);
    }
  });
}

// sgemm's product for small sizes (ops/linalg.py's is_fma_chain), the way eager and the emulated
// GEMM kernels compute it: each C[m, n] one chain c = fmaf(op(A)[m, k], op(B)[k, n], c) for
// k = 0, 1, ... from 0, so a graph's small matmuls equal eager's bit for bit. One thread (these
// products take microseconds). Columns go 64 at a time: op(B)'s [K, 64] slab is copied in order
// (zeros past N), then each row of C keeps 64 chains in flight, which g++ vectorizes (-mfma) into
// independent vector FMAs, every lane's chain unchanged.
inline void fma_chain_gemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda,
                           const float* B, int ldb, float* C, int ldc) {
  constexpr int kCols = 64;
  static thread_local std::vector<float> slab;
  slab.resize((size_t)std::max(K, 1) * kCols);
  for (int n0 = 0; n0 < N; n0 += kCols) {
    const int cols = std::min(kCols, N - n0);
    for (int k = 0; k < K; ++k) {
      float* __restrict__ row = slab.data() + (size_t)k * kCols;
      for (int j = 0; j < cols; ++j)
        row[j] = trans_b ? B[(long long)(n0 + j) * ldb + k] : B[(long long)k * ldb + n0 + j];
      std::fill(row + cols, row + kCols, 0.0f);
    }
    for (int m = 0; m < M; ++m) {
      float acc[kCols] = {};
      for (int k = 0; k < K; ++k) {
        const float a = trans_a ? A[(long long)k * lda + m] : A[(long long)m * lda + k];
        const float* __restrict__ b = slab.data() + (size_t)k * kCols;
        for (int j = 0; j < kCols; ++j) acc[j] = std::fma(a, b[j], acc[j]);
      }
      std::copy(acc, acc + cols, C + (long long)m * ldc + n0);
    }
  }
}

// C = op(A) @ op(B) as eager computes it (ops/linalg.py is_fma_chain decides `chain`, which a
// kernel works out from its sizes): fused multiply-add chains for a small product, else sgemm.
inline void gemm(bool chain, bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda,
                 const float* B, int ldb, float* C, int ldc) {
  if (chain)
    fma_chain_gemm(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
  else
    sgemm(trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc);
}

// A per-thread scratch buffer of at least `count` floats, kept between launches (the GEMM's
// accumulators before the epilogue, a convolution's columns).
inline float* scratch(long long count, int slot = 0) {
  static thread_local std::vector<float> buffers[2];
  std::vector<float>& b = buffers[slot];
  if ((long long)b.size() < count) b.resize(count);
  return b.data();
}

// The Philox4x32-10 stream of dropout and the random ops (flowgen_philox.h's rounds, which
// flowgen/random.py defines), drawn a block at a time: word idx of stream (seed, offset) is word
// idx % 4 of the block with counter (idx / 4, offset), so a loop over consecutive indices computes
// each block once where flowgen_philox_uniform computes it for every word. One per loop piece (it
// keeps the last block); `uniform` is flowgen_philox_uniform's number.
class Philox {
 public:
  float uniform(unsigned long long seed, unsigned long long offset, long long idx) {
    const unsigned int counter = (unsigned int)((unsigned long long)idx >> 2);
    if (!filled_ || counter != counter_ || seed != seed_ || offset != offset_) fill(seed, offset, counter);
    return (float)(words_[idx & 3] >> 8) * (1.0f / 16777216.0f);
  }

 private:
  void fill(unsigned long long seed, unsigned long long offset, unsigned int counter) {
    flowgen_philox_block(seed, offset, counter, words_);
    seed_ = seed;
    offset_ = offset;
    counter_ = counter;
    filled_ = true;
  }

  unsigned long long seed_ = 0, offset_ = 0;
  unsigned int counter_ = 0, words_[4] = {0, 0, 0, 0};
  bool filled_ = false;
};

// Keys (or queries) per chunk of attention's dot products (column_dots).
constexpr int kDotColumns = 16;

// out[t] = sum over d < n of a[d] * cols[d * ld + t], for t < kDotColumns: each sum from 0 in the
// order d = 0, 1, ... with every product rounded (attention.cu.j2's order for q_i . k_j, so the
// same numbers), the kDotColumns sums side by side in vector lanes. `cols` holds the other
// operands transposed (transpose_padded), one per column.
inline void column_dots(const float* a, const float* cols, long long ld, int n, float* out) {
  float acc[kDotColumns] = {};
  for (int d = 0; d < n; ++d) {
    const float ad = a[d];
    const float* c = cols + d * ld;
    for (int t = 0; t < kDotColumns; ++t) acc[t] += ad * c[t];
  }
  for (int t = 0; t < kDotColumns; ++t) out[t] = acc[t];
}

// dst[c * ld + r] = src[r * cols + c] for r < rows, and 0 for rows <= r < ld: a [rows, cols] matrix
// transposed into rows of ld (column_dots' operand, its tail chunk reading zeros).
inline void transpose_padded(const float* src, long long rows, int cols, long long ld, float* dst) {
  for (int c = 0; c < cols; ++c) {
    float* out = dst + c * ld;
    for (long long r = 0; r < rows; ++r) out[r] = src[r * cols + c];
    for (long long r = rows; r < ld; ++r) out[r] = 0.0f;
  }
}

// Convolution geometry of one group: `channels` input channels of H x W, a KH x KW window with
// stride, padding and dilation, an OH x OW output; `images` in the batch, `image_stride` floats
// apart in the input (all C channels of an image).
struct ConvShape {
  int channels, H, W, KH, KW, SH, SW, PH, PW, DH, DW, OH, OW, images;
  long long image_stride;
};

// col[(c * KH + kh) * KW + kw][b * OH * OW + oh * OW + ow] = x[b][c][oh * SH - PH + kh * DH][ow * SW - PW + kw * DW]
// (0 outside the image): every image's patches side by side, the K x (images * OH * OW) operand of
// the conv's one GEMM per group. The pool splits the rows.
inline void im2col(const ConvShape& s, const float* x, float* col) {
  const long long rows = (long long)s.channels * s.KH * s.KW, pixels = (long long)s.OH * s.OW;
  parallel_for(rows, kParallelElements / (pixels * s.images) + 1, [&](long long r0, long long r1) {
  for (long long r = r0; r < r1; ++r) {
    const int c = (int)(r / (s.KH * s.KW)), kh = (int)(r / s.KW % s.KH), kw = (int)(r % s.KW);
    for (int b = 0; b < s.images; ++b) {
      const float* plane = x + b * s.image_stride + (long long)c * s.H * s.W;
      float* out = col + (r * s.images + b) * pixels;
      for (int oh = 0; oh < s.OH; ++oh) {
        const int ih = oh * s.SH - s.PH + kh * s.DH;
        float* row = out + (long long)oh * s.OW;
        if (ih < 0 || ih >= s.H) {
          std::memset(row, 0, sizeof(float) * s.OW);
          continue;
        }
        for (int ow = 0; ow < s.OW; ++ow) {
          const int iw = ow * s.SW - s.PW + kw * s.DW;
          row[ow] = iw >= 0 && iw < s.W ? plane[(long long)ih * s.W + iw] : 0.0f;
        }
      }
    }
  }
  });
}

// The adjoint of im2col: x[b][c][ih][iw] = the sum of the col entries im2col reads from there (x
// is overwritten). Images and channels are independent, so the pool splits them.
inline void col2im(const ConvShape& s, const float* col, float* x) {
  const long long pixels = (long long)s.OH * s.OW, planes = (long long)s.images * s.channels;
  parallel_for(planes, kParallelElements / (s.KH * s.KW * pixels) + 1, [&](long long p0, long long p1) {
  for (long long bc = p0; bc < p1; ++bc) {
    const int b = (int)(bc / s.channels), c = (int)(bc % s.channels);
    float* plane = x + b * s.image_stride + (long long)c * s.H * s.W;
    std::memset(plane, 0, sizeof(float) * s.H * s.W);
    for (int kh = 0; kh < s.KH; ++kh)
      for (int kw = 0; kw < s.KW; ++kw) {
        const float* in = col + ((((long long)c * s.KH + kh) * s.KW + kw) * s.images + b) * pixels;
        for (int oh = 0; oh < s.OH; ++oh) {
          const int ih = oh * s.SH - s.PH + kh * s.DH;
          if (ih < 0 || ih >= s.H) continue;
          for (int ow = 0; ow < s.OW; ++ow) {
            const int iw = ow * s.SW - s.PW + kw * s.DW;
            if (iw >= 0 && iw < s.W) plane[(long long)ih * s.W + iw] += in[(long long)oh * s.OW + ow];
          }
        }
      }
  }
  });
}

// dst[c][b][p] = src[b][c][p] for `images` x `channels` x `pixels` (NCHW to channel-major: the
// conv's gradient as the (channels x images * pixels) GEMM operand).
inline void channel_major(const float* src, int images, int channels, long long pixels, float* dst) {
  parallel_for(channels, kParallelElements / (images * pixels) + 1, [&](long long c0, long long c1) {
    for (long long c = c0; c < c1; ++c)
      for (int b = 0; b < images; ++b)
        std::memcpy(dst + (c * images + b) * pixels, src + ((long long)b * channels + c) * pixels,
                    sizeof(float) * pixels);
  });
}

}  // namespace flowgen_cpu

namespace flowgen_emu {

// FLOWGEN_EMU_KERNEL(k, flowgen_cpu::Native{}): the kernel's body runs once, on the calling thread.
template <class... Params>
void launch(void (*kernel)(Params...), const char*, const unsigned*, const unsigned*, size_t, void** args,
            flowgen_cpu::Native) {
  call_with_args(kernel, args, std::index_sequence_for<Params...>{});
}

}  // namespace flowgen_emu
