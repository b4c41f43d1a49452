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

inline float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

// Generic versions: float (also the compute type of fp16/bf16) uses the above, double libm.
inline float vexp(float x) { return exp_f32(x); }
inline double vexp(double x) { return std::exp(x); }
inline float vtanh(float x) { return tanh_f32(x); }
inline double vtanh(double x) { return std::tanh(x); }
inline float vsigmoid(float x) { return sigmoid_f32(x); }
inline double vsigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace needle
