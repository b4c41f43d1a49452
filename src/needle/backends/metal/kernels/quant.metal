// Weight-only quantized matrices (docs/quantization.md; numpy_ref/quant.py is the reference).
//  * qmv{8,4}_{f16,bf16,f32}: out (m, n) = x (m, k) @ W.T for small m, a simd-group per 2 rows
//    of W; each lane reads whole packed words (4 or 8 values) and dequantizes them in registers.
//  * dequant{8,4}_{f16,bf16,f32}: W (n, k) in the activation dtype, for prefill products.
#include <metal_stdlib>
using namespace metal;

#define QMV_ROWS 2  // rows of W per simd-group (gpu/quant.py's QMV_ROWS)

struct QuantParams {
  long m, n, k, words, groups, group, has_offsets, staged, group_shift;  // staged: CUDA only
};

// Element e of a packed word as its stored value (int8: signed byte; int4: nibble 0..15).
template <int BITS>
inline float stored(uint word, int e) {
  const uint v = (word >> uint(e * BITS)) & ((1u << BITS) - 1u);
  if (BITS == 8) return float(int(v) - (v >= 128u ? 256 : 0));
  return float(v);
}

template <int BITS>
inline float weight(float v, device const float* s, device const float* b, long at, bool off) {
  if (off) return fma(v, s[at], b[at]);
  return (BITS == 4 ? v - 8.0f : v) * s[at];
}

template <class T, int BITS>
kernel void qmv(device const T* x [[buffer(0)]], device const uint* q [[buffer(1)]],
                device const float* s [[buffer(2)]], device const float* b [[buffer(3)]],
                device T* out [[buffer(4)]], constant QuantParams& p [[buffer(5)]],
                uint3 group [[threadgroup_position_in_grid]],
                uint3 tid [[thread_position_in_threadgroup]],
                uint3 tpg [[threads_per_threadgroup]]) {
  const int PER = 32 / BITS;
  const bool off = p.has_offsets != 0;
  device const T* xr = x + long(group.y) * p.k;
  for (long i = 0; i < QMV_ROWS; i++) {  // the generic GPU launch gives each simd-group 2 rows
    const long r = (long(group.x) * tpg.y + tid.y) * QMV_ROWS + i;
    if (r >= p.n) return;  // the whole simd-group
    device const uint* row = q + r * p.words;
    float acc = 0.0f;
    for (long w = tid.x; w < p.words; w += 32) {
      const uint word = row[w];
      for (int e = 0; e < PER; e++) {
        const long j = w * PER + e;
        if (j >= p.k) break;
        acc += float(load(xr[j])) * weight<BITS>(stored<BITS>(word, e), s, b,
                                                  r * p.groups + j / p.group, off);
      }
    }
    acc = simd_sum(acc);
    if (tid.x == 0) out[long(group.y) * p.n + r] = store<T>(acc);
  }
}

template <class T, int BITS>
kernel void dequant(device const uint* q [[buffer(0)]], device const float* s [[buffer(1)]],
                    device const float* b [[buffer(2)]], device T* out [[buffer(3)]],
                    constant QuantParams& p [[buffer(4)]], GRID_ARGS) {
  const int PER = 32 / BITS;
  const bool off = p.has_offsets != 0;
  GRID_STRIDE(t, p.n * p.words) {
    const long r = t / p.words, j0 = (t - r * p.words) * PER;
    const uint word = q[t];
    for (int e = 0; e < PER; e++) {
      const long j = j0 + e;
      if (j >= p.k) break;
      out[r * p.k + j] = store<T>(weight<BITS>(stored<BITS>(word, e), s, b,
                                               r * p.groups + j / p.group, off));
    }
  }
}

#define QUANT(unused, SFX, T)                                  \
  INSTANTIATE(NAME(qmv8_##SFX), qmv<T, 8>)                     \
  INSTANTIATE(NAME(qmv4_##SFX), qmv<T, 4>)                     \
  INSTANTIATE(NAME(dequant8_##SFX), dequant<T, 8>)             \
  INSTANTIATE(NAME(dequant4_##SFX), dequant<T, 4>)
FLOATS(QUANT, _)
