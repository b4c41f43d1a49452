// Weight-only quantized matrices (docs/quantization.md; numpy_ref/quant.py is the reference).
//  * qmv{8,4}_{f16,bf16,f32}: out (m, n) = x (m, k) @ W.T for small m (decoding), one warp per
//    QMV_ROWS rows of W, grid.y over the m rows of x. Bandwidth-bound: each lane issues
//    QMV_UNROLL x QMV_ROWS independent 16-byte loads of packed weights (bypassing L1) before
//    using any; values become floats in registers (a byte_perm into the mantissa of 2^23 and
//    one subtraction: 3 instructions a value with the FMA), are dotted with x staged as float
//    in shared memory, and each 16-byte chunk's dot is scaled once (chunks never straddle a
//    group).
//  * dequant{8,4}_{f16,bf16,f32}: W (n, k) in the activation dtype, for prefill products
//    (the generic GPU backend then runs the dtype's GEMM).
#include "common.cuh"
#include "quant.cuh"

#ifndef QMV_ROWS
#define QMV_ROWS 2
#endif
#ifndef QMV_UNROLL
#define QMV_UNROLL 6  // chunks a lane requests at once per row: all of a 5632-wide int4 row
#endif

// staged: 1 for the fast path (gpu/quant.py decides); group_shift: log2 of the chunks per
// group when that is a power of two (30 for one group per row), else -1
struct QuantParams { i64 m, n, k, words, groups, group, has_offsets, staged, group_shift; };

// The stored value of element j of a row (slow path: any k and group).
template <int BITS> __device__ __forceinline__ float value_at(const u32* row, i64 j) {
  if (BITS == 8) return (float)(signed char)((row[j >> 2] >> ((j & 3) * 8)) & 0xFFu);
  return (float)((row[j >> 3] >> ((j & 7) * 4)) & 15u);
}

// Fast path (params.staged): k a multiple of the 16-byte chunk's E values, groups whole
// chunks. The group first stages x (as float) in shared memory, transposed so that float4 j
// of chunk c sits at [j][c]: the 32 lanes of a warp read 32 neighbouring chunks without bank
// conflicts; with offsets, each chunk's x-sum too (the offset term is b * sum(x)).
template <class T, int BITS>
__device__ __forceinline__ void qmv_staged(const T* __restrict__ x, const u32* __restrict__ q,
                                           const float* __restrict__ s,
                                           const float* __restrict__ b, T* __restrict__ out,
                                           const QuantParams& p, float* smem) {
  constexpr int R = QMV_ROWS, U = QMV_UNROLL, E = 128 / BITS;
  const int k = (int)p.k, chunks = k / E, threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * 32 + threadIdx.x, lane = threadIdx.x;
  const bool offsets = p.has_offsets != 0;
  const i64 row0 = ((i64)blockIdx.x * blockDim.y + threadIdx.y) * R;
  const bool active = row0 < p.n;
  const uint4* qrow[R];
  const float* srow[R];
  const float* brow[R];
#pragma unroll
  for (int i = 0; i < R; i++) {
    const i64 r = row0 + i < p.n ? row0 + i : (active ? row0 : 0);  // duplicates: never written
    qrow[i] = reinterpret_cast<const uint4*>(q + r * p.words);
    srow[i] = s + r * p.groups;
    brow[i] = offsets ? b + r * p.groups : s;
  }
  // The first U chunks of each row are requested before x is staged, so the two latencies
  // overlap (a 2048-wide int4 row is 2 chunks a lane: the whole matrix is in flight at once).
  uint4 w[U][R];
  auto fetch = [&](int c0) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int i = 0; i < R; i++) {
        if (active && c < chunks) {
          w[u][i] = ld_stream16(qrow[i] + c);
        }
      }
    }
  };
  fetch(lane);
  float4* xs = reinterpret_cast<float4*>(smem);  // [E / 4][chunks]
  float* xsum = smem + k;                          // [chunks]
  stage_x<T, E, false>(x, x, 1.f, k, smem, tid, threads);
  __syncthreads();
  if (offsets) {
    chunk_sums<E>(smem, k, xsum, tid, threads);
    __syncthreads();
  }
  if (!active) return;
  const int shift = (int)p.group_shift, per_group = (int)(p.group / E);
  const float magic = value_magic<BITS>(offsets);
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; i++) acc[i] = 0.f;
  for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
    if (c0 != lane) fetch(c0);
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      const int g = shift >= 0 ? c >> shift : c / per_group;
      const float xs_c = offsets ? xsum[c] : 0.f;
#pragma unroll
      for (int i = 0; i < R; i++) {
        const float dot = chunk_dot<BITS>(w[u][i], xs + c, chunks, magic);
        acc[i] = offsets ? fmaf(srow[i][g], dot, fmaf(brow[i][g], xs_c, acc[i]))
                         : fmaf(srow[i][g], dot, acc[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < R; i++) {
    const float total = warp_sum(acc[i]);
    if (lane == 0 && row0 + i < p.n) out[row0 + i] = store<T>(total);
  }
}

// Any shape: lanes over the elements of R rows, values unpacked one at a time.
template <class T, int BITS>
__device__ __forceinline__ void qmv_any(const T* __restrict__ x, const u32* __restrict__ q,
                                        const float* __restrict__ s, const float* __restrict__ b,
                                        T* __restrict__ out, const QuantParams& p) {
  constexpr int R = QMV_ROWS;
  const i64 row0 = ((i64)blockIdx.x * blockDim.y + threadIdx.y) * R;
  if (row0 >= p.n) return;
  const bool offsets = p.has_offsets != 0;
  float acc[R];
#pragma unroll
  for (int i = 0; i < R; i++) acc[i] = 0.f;
  for (i64 j = threadIdx.x; j < p.k; j += 32) {
    const float xj = load(x[j]);
    const i64 g = j / p.group;
#pragma unroll
    for (int i = 0; i < R; i++) {
      const i64 r = row0 + i < p.n ? row0 + i : row0;
      const i64 at = r * p.groups + g;
      const float v = value_at<BITS>(q + r * p.words, j);
      const float w = offsets ? fmaf(v, s[at], b[at]) : (BITS == 4 ? v - 8.0f : v) * s[at];
      acc[i] = fmaf(xj, w, acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < R; i++) {
    const float total = warp_sum(acc[i]);
    if (threadIdx.x == 0 && row0 + i < p.n) out[row0 + i] = store<T>(total);
  }
}

// One thread per packed word: its 4 (int8) or 8 (int4) elements of W, in out's dtype, stored
// with one vector store where the row's length allows (8 bf16 from an int4 word: 16 bytes);
// rows or groups that split a word take the general path (a group index per value).
template <class T, int BITS>
__device__ __forceinline__ void dequant(const u32* __restrict__ q, const float* __restrict__ s,
                                        const float* __restrict__ b, T* __restrict__ out,
                                        const QuantParams& p) {
  constexpr int PER = 32 / BITS;
  const bool offsets = p.has_offsets != 0;
  const bool vec = p.k % PER == 0;
  const i64 total = p.n * p.words;
  if (vec && p.group % PER == 0 && p.n * p.k < (1ll << 31)) {
    // every model's case: a word's values share one group, so one scale (and offset) a word,
    // and 32-bit indices (this loop's 64-bit divisions, one a value, were its bound)
    const u32 words = (u32)p.words, per_group = (u32)(p.group / PER), groups = (u32)p.groups;
    const u32 k = (u32)p.k;
    for (u32 t = (u32)global_thread(); t < (u32)total; t += (u32)grid_threads()) {
      const u32 r = t / words, w = t - r * words, g = r * groups + w / per_group;
      const u32 word = q[t];
      const float sc = s[g], of = offsets ? b[g] : 0.f;
      Vec<T, PER> v;
#pragma unroll
      for (int e = 0; e < PER; e++) {
        const u32 bitsv = (word >> (e * BITS)) & ((1u << BITS) - 1u);
        const float x = BITS == 8 ? (float)(signed char)bitsv : (float)bitsv;
        v.v[e] = store<T>(offsets ? fmaf(x, sc, of) : (BITS == 4 ? x - 8.0f : x) * sc);
      }
      *reinterpret_cast<Vec<T, PER>*>(out + r * k + w * PER) = v;
    }
    return;
  }
  for (i64 t = global_thread(); t < total; t += grid_threads()) {
    const i64 r = t / p.words, j0 = (t - r * p.words) * PER;
    const u32 word = q[t];
    const float* sr = s + r * p.groups;
    const float* br = offsets ? b + r * p.groups : s;
    Vec<T, PER> v;
#pragma unroll
    for (int e = 0; e < PER; e++) {
      const i64 j = j0 + e;
      const i64 g = (j < p.k ? j : j0) / p.group;
      const u32 bitsv = (word >> (e * BITS)) & ((1u << BITS) - 1u);
      const float x = BITS == 8 ? (float)(signed char)bitsv : (float)bitsv;
      v.v[e] = store<T>(offsets ? fmaf(x, sr[g], br[g]) : (BITS == 4 ? x - 8.0f : x) * sr[g]);
    }
    T* dst = out + r * p.k + j0;
    if (vec) {
      *reinterpret_cast<Vec<T, PER>*>(dst) = v;
    } else {
#pragma unroll
      for (int e = 0; e < PER; e++)
        if (j0 + e < p.k) dst[e] = v.v[e];
    }
  }
}

#define QUANT(SFX, T, BITS)                                                                     \
  extern "C" __global__ void qmv##BITS##_##SFX(const T* __restrict__ x, const u32* __restrict__ q, \
                                              const float* __restrict__ s,                      \
                                              const float* __restrict__ b, T* __restrict__ out, \
                                              QuantParams p) {                                  \
    pdl_entry();                                                                                \
    extern __shared__ __align__(16) float qmv_smem[];                                           \
    const i64 m = blockIdx.y;                                                                   \
    if (p.staged)                                                                               \
      qmv_staged<T, BITS>(x + m * p.k, q, s, b, out + m * p.n, p, qmv_smem);                    \
    else                                                                                        \
      qmv_any<T, BITS>(x + m * p.k, q, s, b, out + m * p.n, p);                                 \
  }                                                                                             \
  extern "C" __global__ void dequant##BITS##_##SFX(const u32* __restrict__ q,                   \
                                                  const float* __restrict__ s,                  \
                                                  const float* __restrict__ b,                  \
                                                  T* __restrict__ out, QuantParams p) {         \
    pdl_entry();                                                                                \
    dequant<T, BITS>(q, s, b, out, p);                                                          \
  }

ONLY(f16, QUANT(f16, half_t, 8) QUANT(f16, half_t, 4))
ONLY(bf16, QUANT(bf16, bf16_t, 8) QUANT(bf16, bf16_t, 4))
ONLY(f32, QUANT(f32, float, 8) QUANT(f32, float, 4))
