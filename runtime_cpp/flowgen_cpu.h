// flowgen_cpu.h — what the cpu target's native kernels (flowgen/codegen/cpu/) share: float32
// GEMMs through OpenBLAS (the scipy-openblas32 wheel's library, NumPy's own BLAS build), spread
// over the OpenMP team, and the im2col / col2im copies of convolutions.
//
// A native kernel is written like an emulated one, `extern "C" __global__ void k(...)` followed
// by `FLOWGEN_EMU_KERNEL(k, flowgen_cpu::Native{})`, so it lives in the same kernels.cu, library
// and launch list; launched with a 1x1x1 grid, its body runs once on the calling thread, which
// opens OpenMP regions itself.
//
// Threads: one pool, OpenMP's. OpenBLAS runs single-threaded inside it (set when the library
// loads): a GEMM large enough to share is split into column (or row) slices, one BLAS call per
// team member, so BLAS's own pthreads never compete with the team for the cores.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

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

// Below this many multiply-adds a GEMM stays on the calling thread (waking the team costs more).
constexpr long long kParallelWork = 1LL << 18;
// Below this many elements an elementwise pass stays on the calling thread.
constexpr long long kParallelElements = 1LL << 15;

// C[M, N] = alpha * op(A) @ op(B) + beta * C, all row-major with leading dimensions lda, ldb,
// ldc; op transposes where asked. Large products are split over the OpenMP team along N (or M
// when it is the larger), slices of whole 16-column blocks, one single-threaded BLAS call each.
inline void sgemm(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda, const float* B,
                  int ldb, float* C, int ldc, float beta = 0.0f) {
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
  const long long work = (long long)M * N * K;
  // Inside a parallel loop (a batched GEMM's entries) each call stays on its own thread.
  const int team = work >= kParallelWork && !omp_in_parallel() ? omp_get_max_threads() : 1;
  if (team <= 1 || std::max(M, N) < 32) {
    scipy_cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const bool split_n = N >= M;
  const int extent = split_n ? N : M;
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int blocks = (extent + 15) / 16;
    const int first = (int)((long long)blocks * t / T) * 16, last = std::min(extent, (int)((long long)blocks * (t + 1) / T) * 16);
    if (first < last) {
      if (split_n) {  // columns [first, last) of B and C
        const float* b = trans_b ? B + (long long)first * ldb : B + first;
        scipy_cblas_sgemm(CblasRowMajor, ta, tb, M, last - first, K, 1.0f, A, lda, b, ldb, beta, C + first, ldc);
      } else {        // rows [first, last) of A and C
        const float* a = trans_a ? A + first : A + (long long)first * lda;
        scipy_cblas_sgemm(CblasRowMajor, ta, tb, last - first, N, K, 1.0f, a, lda, B, ldb, beta,
                          C + (long long)first * ldc, ldc);
      }
    }
  }
}

// A per-thread scratch buffer of at least `count` floats, kept between launches (the GEMM's
// accumulators before the epilogue, a convolution's columns).
inline float* scratch(long long count, int slot = 0) {
  static thread_local std::vector<float> buffers[2];
  std::vector<float>& b = buffers[slot];
  if ((long long)b.size() < count) b.resize(count);
  return b.data();
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
// the conv's one GEMM per group. The team splits the rows.
inline void im2col(const ConvShape& s, const float* x, float* col) {
  const long long rows = (long long)s.channels * s.KH * s.KW, pixels = (long long)s.OH * s.OW;
#pragma omp parallel for if (rows * pixels * s.images >= kParallelElements) schedule(static)
  for (long long r = 0; r < rows; ++r) {
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
}

// The adjoint of im2col: x[b][c][ih][iw] = the sum of the col entries im2col reads from there (x
// is overwritten). Images and channels are independent, so the team splits them.
inline void col2im(const ConvShape& s, const float* col, float* x) {
  const long long pixels = (long long)s.OH * s.OW, planes = (long long)s.images * s.channels;
#pragma omp parallel for if (planes * s.KH * s.KW * pixels >= kParallelElements) schedule(static)
  for (long long bc = 0; bc < planes; ++bc) {
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
}

// dst[c][b][p] = src[b][c][p] for `images` x `channels` x `pixels` (NCHW to channel-major: the
// conv's gradient as the (channels x images * pixels) GEMM operand).
inline void channel_major(const float* src, int images, int channels, long long pixels, float* dst) {
#pragma omp parallel for if ((long long)images * channels * pixels >= kParallelElements) schedule(static)
  for (int c = 0; c < channels; ++c)
    for (int b = 0; b < images; ++b)
      std::memcpy(dst + ((long long)c * images + b) * pixels, src + ((long long)b * channels + c) * pixels,
                  sizeof(float) * pixels);
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
