// attention_tc_bwd.cu's building blocks (fab::): where a row or key of a training array
// lives (AttnGrads), which keys a row sees, tiles into shared memory, and the two mma.sync
// product patterns of FlashAttention on [64][D] swizzled tiles (attention_tc.cuh's layout).
#pragma once
#include "common.cuh"
#include "attention.cuh"
#include "tensor_core.cuh"

namespace fab {
constexpr int BR = 64, BC = 64, THREADS = 128;
constexpr float LOG2E = 1.4426950408889634f;
using tc::ex2;
using tc::swz;

// element offset of row r of KV head kvh (query head kvh * group + r / q_len, position
// r % q_len) in array x; of key j in array x
__device__ __forceinline__ i64 row_at(const AttnGrads& g, int x, i64 b, i64 kvh, i64 r,
                                      const AttnParams& p) {
  const i64 group = p.q_heads / p.kv_heads;
  return g.off[x] + b * g.s[x][0] + (kvh * group + r / p.q_len) * g.s[x][1] +
         (r % p.q_len) * g.s[x][2];
}
__device__ __forceinline__ i64 key_at(const AttnGrads& g, int x, i64 b, i64 kvh, i64 j) {
  return g.off[x] + b * g.s[x][0] + kvh * g.s[x][1] + j * g.s[x][2];
}
// the last key row r may see; -1 for a row past the end
__device__ __forceinline__ i64 row_limit(i64 r, i64 rows_total, const AttnParams& p) {
  return r >= rows_total ? -1 : p.causal ? p.kv_len - p.q_len + r % p.q_len : p.kv_len - 1;
}
// the largest position among rows [r0, r0 + BR)
__device__ __forceinline__ i64 max_pos(i64 r0, i64 rows_total, const AttnParams& p) {
  const i64 last = r0 + BR - 1 < rows_total ? r0 + BR - 1 : rows_total - 1;
  return (r0 / p.q_len != last / p.q_len) ? p.q_len - 1 : last % p.q_len;
}
// rows [r0, r0 + 64) of array x (query rows) or keys [r0, r0 + 64) (key rows) into a
// swizzled [64][D] tile by cp.async, zeros past `end`
template <int D, bool KEYS, class T>
__device__ __forceinline__ void load_tile(u32 dst, const T* base, const AttnGrads& g, int x,
                                          i64 b, i64 kvh, i64 r0, i64 end, const AttnParams& p) {
  constexpr int CH = D / 8;
#pragma unroll
  for (int i = 0; i < 64 * CH / THREADS; i++) {
    const int c = threadIdx.x + i * THREADS, r = c / CH, ch = c % CH;
    const bool ok = r0 + r < end;
    const T* src = base;
    if (ok) src += (KEYS ? key_at(g, x, b, kvh, r0 + r) : row_at(g, x, b, kvh, r0 + r, p)) + ch * 8;
    tc::cp_async16(dst + swz<D>(r, ch), src, ok ? 16 : 0);
  }
}

// acc[NT][4] += A (16 rows of tile `a` from row a0, k along D) times B where B's n are rows
// n0.. of tile `bt` and its k is D: the S = Q Kᵀ pattern of the forward
template <class T, int D, int NT>
__device__ __forceinline__ void rows_dot_rows(float (&acc)[NT][4], u32 a, int a0, u32 bt, int n0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kd = 0; kd < D / 16; kd++) {
    u32 af[4];
    tc::ldsm_x4(a + swz<D>(a0 + (lane & 15), kd * 2 + (lane >> 4)), af);
#pragma unroll
    for (int np = 0; np < NT / 2; np++) {
      u32 t[4];
      tc::ldsm_x4(bt + swz<D>(n0 + np * 16 + ((lane >> 4) << 3) + (lane & 7),
                              kd * 2 + ((lane >> 3) & 1)), t);
      tc::Mma<T>::run(acc[2 * np], af, t[0], t[1]);
      tc::Mma<T>::run(acc[2 * np + 1], af, t[2], t[3]);
    }
  }
}
// acc[D / 8][4] += X (16 x 16 KC, the accumulator layout of x[2 KC][4], rounded to T) times
// rows k0.. of tile `bt` (k along its rows, n along D): the O += P V pattern of the forward
template <class T, int D, int KC>
__device__ __forceinline__ void acc_times_rows(float (&acc)[D / 8][4], const float (&x)[2 * KC][4],
                                               u32 bt, int k0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kc = 0; kc < KC; kc++) {
    const u32 a[4] = {tc::pack2<T>(x[2 * kc][0], x[2 * kc][1]),
                      tc::pack2<T>(x[2 * kc][2], x[2 * kc][3]),
                      tc::pack2<T>(x[2 * kc + 1][0], x[2 * kc + 1][1]),
                      tc::pack2<T>(x[2 * kc + 1][2], x[2 * kc + 1][3])};
#pragma unroll
    for (int np = 0; np < D / 16; np++) {
      u32 t[4];
      tc::ldsm_x4_t(bt + swz<D>(k0 + kc * 16 + (lane & 15), np * 2 + (lane >> 4)), t);
      tc::Mma<T>::run(acc[2 * np], a, t[0], t[1]);
      tc::Mma<T>::run(acc[2 * np + 1], a, t[2], t[3]);
    }
  }
}
template <int N> __device__ __forceinline__ void zero(float (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) x[i][e] = 0.f;
}
// rows (or keys) g and g + 8 of the warp's 16 from accumulators, times `mul`, as T pairs
template <class T, int D>
__device__ __forceinline__ void store_rows(T* dst0, T* dst1, const float (&x)[D / 8][4], float mul) {
  const int t4 = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < D / 8; n++) {
    if (dst0) *reinterpret_cast<u32*>(dst0 + n * 8 + t4 * 2) = tc::pack2<T>(x[n][0] * mul, x[n][1] * mul);
    if (dst1) *reinterpret_cast<u32*>(dst1 + n * 8 + t4 * 2) = tc::pack2<T>(x[n][2] * mul, x[n][3] * mul);
  }
}
}  // namespace fab
