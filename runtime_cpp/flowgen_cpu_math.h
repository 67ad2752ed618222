// flowgen_cpu_math.h — the float32 exp, erf, erfc and tanh that the cpu target's native loops
// call instead of libm's expf, erff, erfcf and tanhf (flowgen/codegen/cpu/elementwise.py's NATIVE_MATH maps
// the names). libm's are scalar calls, erfcf about 8 ns each: in a GEMM's GELU epilogue they cost
// more than the product. These are inline, branch-free (selects, no early returns) and use only
// float and int operations and std::fma, so g++ vectorizes a loop calling them, and every
// optimisation level, scalar or vectorized, computes the same operations: the same numbers (and a
// nan argument comes back as itself, whose sign and payload no operand order can change).
//
// Accuracy against float64 libm, every float of the range where the results are neither 0 nor
// saturated: expf 0.78 ulp (in the subnormals), erff 0.99, erfcf 2.89 (CUDA's erfcf: 4), tanhf 1.48.
// tests/test_cpu_math.py checks these bounds on 8 million floats across every binade, and that
// inf, nan, +-0, overflow to inf, underflow through the subnormals to 0 and saturation to +-1
// (erf, tanh) or 0 and 2 (erfc) are exact.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Inlined into every loop, however large the loop body grows: a call would keep the loop scalar.
#define FLOWGEN_MATH_INLINE inline __attribute__((always_inline))

namespace flowgen_cpu {

namespace math_detail {

FLOWGEN_MATH_INLINE std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

FLOWGEN_MATH_INLINE float float_of(std::uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

}  // namespace math_detail

// exp(x), within 1 ulp. Cody and Waite's reduction: k = round(x / ln 2), r = x - k ln 2 with
// ln 2 in two parts, |r| <= ln 2 / 2; exp(r) by its Taylor series to r^7 (the r^8 term is below
// 2^-27 relative), then scaled by 2^k in two exact steps so that subnormal results round once.
FLOWGEN_MATH_INLINE float expf(float x) {
  constexpr float kShift = 0x1.8p23f;   // x + kShift rounds x to an integer held in the low bits
  // exp(89) overflows and exp(-104) rounds to 0 already: the clamp keeps k in [-151, 129] (nan stays nan)
  const float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float shifted = std::fma(xc, 0x1.715476p+0f, kShift);
  const float k = shifted - kShift;
  const std::int32_t ki = (std::int32_t)(math_detail::bits_of(shifted) - math_detail::bits_of(kShift));
  // ln 2 = 0x1.62e430p-1 - 0x1.05c610p-29: k times the first part is exact, so r0 is too; r is
  // r0 + k * 0x1.05c610p-29 rounded, r_lo what that rounding left out
  const float r0 = std::fma(k, -0x1.62e430p-1f, xc);
  const float r = std::fma(k, 0x1.05c610p-29f, r0);
  const float r_lo = std::fma(k, 0x1.05c610p-29f, r0 - r);
  float q = 1.0f / 5040;
  q = std::fma(q, r, 1.0f / 720);
  q = std::fma(q, r, 1.0f / 120);
  q = std::fma(q, r, 1.0f / 24);
  q = std::fma(q, r, 1.0f / 6);
  q = std::fma(q, r, 0.5f);
  // exp(r) = 1 + r + r^2 q(r): 1 + r rounded and its error (exact, as |r| < 1), then the small
  // terms, so that one rounding of a value near 1 remains, not two (which cost up to 1.06 ulp)
  const float one_r = 1.0f + r;
  const float one_r_lo = (1.0f - one_r) + r;
  const float p = one_r + (one_r_lo + std::fma(r * r, q, r_lo));
  // 2^k = 2^h * 2^(k - h), both normal for k in [-151, 129]
  const std::int32_t h = ki >> 1;
  const float scale_1 = math_detail::float_of((std::uint32_t)(h + 127) << 23);
  const float scale_2 = math_detail::float_of((std::uint32_t)(ki - h + 127) << 23);
  return x != x ? x : p * scale_1 * scale_2;   // nan: x's own, whichever lanes computed it
}

namespace math_detail {

// erf(x) for |x| < 1: x (1 + P(x^2)), P a float32 least-squares fit of degree 6 (0.03 ulp from
// erf(x) / x - 1; its constant term 2 / sqrt(pi) - 1 rounds with little error, 2 / sqrt(pi) would not).
FLOWGEN_MATH_INLINE float erf_near_zero(float x) {
  const float u = x * x;
  float p = 0x1.48edeep-14f;
  p = std::fma(p, u, -0x1.a3c95cp-11f);
  p = std::fma(p, u, 0x1.53ff92p-8f);
  p = std::fma(p, u, -0x1.b7f858p-6f);
  p = std::fma(p, u, 0x1.ce2cf0p-4f);
  p = std::fma(p, u, -0x1.81273ep-2f);
  p = std::fma(p, u, 0x1.06eba8p-3f);
  return std::fma(x, p, x);
}

// erfc(a) for a >= 0 (or nan). erfc(a) = exp(-a^2) * (1 + g(q)) / (1 + 2a), where
// (1 + 2a) exp(a^2) erfc(a) runs smoothly from 1 at a = 0 to 2 / sqrt(pi) as a grows, written
// as a polynomial g in q = (a - 2) / (a + 2), which maps [0, 10.1] onto [-1, 0.67] (the change of
// variable of Juffa's erfcf; these coefficients are a float32 least-squares fit of degree 11,
// 0.11 ulp from the function). exp(-a^2) takes a^2 as s plus the rounding error t = s - a^2
// (an fma gives it exactly): exp(-a^2) = exp(-s) exp(t) ~ exp(-s) (1 + t); s alone would be off
// by up to 2^-18 near a = 10 (half an ulp of 100), and exp(-s) by as much relative: 64 ulp.
FLOWGEN_MATH_INLINE float erfc_nonnegative(float a0) {
  const float a = a0 > 10.1f ? 10.1f : a0;   // erfc(10.1) rounds to 0; keeps q finite at inf (nan stays nan)
  const float q = (a - 2.0f) / (a + 2.0f);
  float g = 0x1.7eb6c8p-14f;
  g = std::fma(g, q, 0x1.8c3f08p-13f);
  g = std::fma(g, q, -0x1.aecb5ap-12f);
  g = std::fma(g, q, -0x1.7b7ffep-10f);
  g = std::fma(g, q, 0x1.48baf4p-10f);
  g = std::fma(g, q, 0x1.1dd5b0p-7f);
  g = std::fma(g, q, -0x1.072170p-7f);
  g = std::fma(g, q, -0x1.bc2ddcp-5f);
  g = std::fma(g, q, 0x1.4ff9e4p-3f);
  g = std::fma(g, q, -0x1.5407a4p-3f);
  g = std::fma(g, q, -0x1.7bf5e8p-4f);
  g = std::fma(g, q, 0x1.1ba038p-2f);
  // exp(a^2) erfc(a) = (1 + g) / (1 + 2a): a first quotient through the reciprocal, then corrected by
  // its residual (1 + g) - y (1 + 2a), taken with a itself, not the rounded 1 + 2a (a plain division
  // of the rounded terms cost up to 4 ulp in all)
  const float reciprocal = 1.0f / std::fma(2.0f, a, 1.0f);
  const float y = std::fma(g, reciprocal, reciprocal);
  const float residual = std::fma(std::fma(y, -a, 0.5f), 2.0f, g - y);
  const float scaled = std::fma(residual, reciprocal, y);
  const float s = a * a;
  const float t = std::fma(a, -a, s);
  const float e = flowgen_cpu::expf(-s);
  return scaled * std::fma(e, t, e);
}

}  // namespace math_detail

// erfc(x), within 3 ulp. |x| < 0.47: 1 - erf(x), the result in [0.5, 1.5] (erfc_nonnegative
// rounds terms just above 1, 1 + g and 1 + 2a, whose ulp is twice a result's just below 1: 4 ulp
// there); else erfc_nonnegative(|x|), and erfc(x) = 2 - erfc(-x) for x < 0.
FLOWGEN_MATH_INLINE float erfcf(float x) {
  const float tail = math_detail::erfc_nonnegative(std::fabs(x));
  const float far = x < 0.0f ? 2.0f - tail : tail;
  const float result = std::fabs(x) < 0.47f ? 1.0f - math_detail::erf_near_zero(x) : far;
  return x != x ? x : result;
}

// erf(x), within 1 ulp: erf_near_zero for |x| < 1, else 1 - erfc(|x|) with x's sign, where
// erfc(|x|) < 0.16 loses nothing to the subtraction.
FLOWGEN_MATH_INLINE float erff(float x) {
  const float far = std::copysign(1.0f - math_detail::erfc_nonnegative(std::fabs(x)), x);
  const float result = std::fabs(x) < 1.0f ? math_detail::erf_near_zero(x) : far;
  return x != x ? x : result;
}

// tanh(x), within 2 ulp, from a = |x| with x's sign: a < 0.55: a + a u P(u), u = a^2, P a float32
// least-squares fit of degree 4 (0.02 ulp from (tanh(a) / a - 1) / u); else 1 - 2 / (exp(2a) + 1),
// at least 0.5, which exp(2a)'s rounding moves by under an ulp (exp(2a) = inf gives 1).
FLOWGEN_MATH_INLINE float tanhf(float x) {
  const float a = std::fabs(x), u = a * a;
  float p = -0x1.9a449ep-8f;
  p = std::fma(p, u, 0x1.590fcep-6f);
  p = std::fma(p, u, -0x1.b92268p-5f);
  p = std::fma(p, u, 0x1.110cfcp-3f);
  p = std::fma(p, u, -0x1.55554ap-2f);
  const float near_zero = std::fma(a * u, p, a);
  const float far = 1.0f - 2.0f / (flowgen_cpu::expf(2.0f * a) + 1.0f);
  const float result = std::copysign(a < 0.55f ? near_zero : far, x);
  return x != x ? x : result;
}

}  // namespace flowgen_cpu
