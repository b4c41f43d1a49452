// Branch-free float32 math that the compiler can vectorize (libm calls stop vectorization).
// Accuracy is a few ulp, well inside the backend's fp32 tolerance; NaN and inf behave as in
// numpy. float64 uses libm.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace needle {

// exp(x) = 2^n * exp(r) with r = x - n*ln2 in [-ln2/2, ln2/2] and a Cephes polynomial for
// exp(r). 2^n is applied in two halves so that results in the subnormal range round once.
inline float exp_f32(float x) {
  float xc = x < -104.0f ? -104.0f : x;
  xc = xc > 89.0f ? 89.0f : xc;
  xc = x != x ? 0.0f : xc;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t ni = (int32_t)n;  // in [-150, 128]
  const int32_t n1 = ni / 2, n2 = ni - n1;
  const float s1 = bits_f32((uint32_t)(n1 + 127) << 23);
  const float s2 = bits_f32((uint32_t)(n2 + 127) << 23);
  const float y = p * s1 * s2;
  return x != x ? x : y;
}

// Cephes tanhf: an odd polynomial near 0, 1 - 2/(exp(2|x|) + 1) elsewhere.
inline float tanh_f32(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  float small = -5.70498872745e-3f;
  small = small * z + 2.06390887954e-2f;
  small = small * z - 5.37397155531e-2f;
  small = small * z + 1.33314422036e-1f;
  small = small * z - 3.33332819422e-1f;
  small = small * z * x + x;
  const float big = 1.0f - 2.0f / (exp_f32(2.0f * ax) + 1.0f);
  return ax < 0.625f ? small : (x < 0.0f ? -big : big);
}

// Cephes logf: x = 2^e * m with m in [sqrt(1/2), sqrt(2)), log(m) by a polynomial in m - 1.
// Subnormals are scaled up first; x < 0 gives NaN, 0 gives -inf, inf stays inf.
inline float log_f32(float x) {
  const bool sub = x < 1.17549435e-38f;
  const float xs = sub ? x * 8388608.0f : x;  // 2^23
  const uint32_t bits = f32_bits(xs);
  int32_t e = (int32_t)((bits >> 23) & 0xFF) - 126 - (sub ? 23 : 0);
  float m = bits_f32((bits & 0x007FFFFFu) | 0x3F000000u);  // in [0.5, 1)
  const bool small = m < 0.707106781186547524f;
  e -= small ? 1 : 0;
  m = small ? m + m : m;
  const float f = m - 1.0f;
  const float z = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  const float fe = (float)e;
  float y = f * z * p + fe * -2.12194440e-4f - 0.5f * z;
  y = f + y + fe * 0.693359375f;
  y = x == 0.0f ? -INFINITY : y;
  y = x < 0.0f ? NAN : y;
  return (x != x || x == INFINITY) ? x : y;
}

inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

// Generic versions: float (also the compute type of fp16/bf16) uses the above, double libm.
inline float vexp(float x) { return exp_f32(x); }
inline double vexp(double x) { return std::exp(x); }
inline float vlog(float x) { return log_f32(x); }
inline double vlog(double x) { return std::log(x); }
inline float vtanh(float x) { return tanh_f32(x); }
inline double vtanh(double x) { return std::tanh(x); }
inline float vsigmoid(float x) { return sigmoid_f32(x); }
inline double vsigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace needle
