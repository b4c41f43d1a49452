// Training attention on tensor cores, float16/bfloat16 with head_dim 64 or 128 (sm_80+;
// docs/kernels.md, "attention_backward"):
//  * attention_tc{D}_train_{sfx}: attention_tc.cuh's forward with K and V read through
//    KVRows (a model's token-major projections) and each row's max and 1 / sum kept.
//  * attention_tc{D}_bwd_dq_{sfx} (and ..._dqs_..., which first recomputes the statistics
//    where the forward kept none): a group of 4 warps owns 64 query rows of one (batch, KV
//    head), numbered as the forward's (row r: query head kv_head * group + r / q_len,
//    position r % q_len), each warp 16. It computes each row's D = dO . O (kept in `drow`
//    for the next kernel) and walks the key tiles the rows can see, two stages of K and V in
//    flight: S = Q Kᵀ and dP = dO Vᵀ, P = exp(S - m) / l, dS = P (dP - D), dQ += dS K, all
//    on mma.sync with fp32 accumulators, dS never leaving registers (as P in the forward).
//  * attention_tc{D}_bwd_dkv_{sfx}: a group owns 64 keys of one (batch, KV head), each warp
//    16, K and V in shared memory; it walks the query tiles that can see them (every query
//    head of the KV head: the grouped heads' sum is in the walk), two stages of Q, dO and the
//    rows' m, 1 / l, D and last visible key in flight: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, Pᵀ and dSᵀ
//    in registers, dV += Pᵀ dO and dK += dSᵀ Q. Sᵀ and dPᵀ are made 64 (D = 128: 16) query
//    columns at a time so dK, dV and them fit the registers. Where there are few key blocks
//    (one sequence, few KV heads) the walk is split by query heads (p.splits parts): each
//    part writes float32 sums to `part`, and attention_tc_sum_parts_{sfx} adds them in order.
// FlashAttention-2's backward without its atomics: dQ in a kernel of its own (two more
// products) keeps the result independent of the order groups finish and needs no
// (blocks x dq) slabs. Every array is read and written through AttnGrads' strides.
#include "common.cuh"
#include "attention.cuh"
#include "attention_tc.cuh"
#include "attention_tc_bwd.cuh"  // fab:: building blocks

// tuning knobs (NEEDLE_CUDA_OPTIONS): groups an SM the dQ and dK/dV kernels are compiled for
// at head size 64 and 128 (the registers they may use: 2 -> 255, 3 -> 168; H200, 1 x 2,048
// tokens, 32 / 4 heads of 64: dK/dV 280 -> 322 us at 3), and the query columns of Sᵀ and dPᵀ
// the dK/dV kernel makes at a time (head size 128: 32 -> 16 took it from 558 to 471 us at
// 24 / 8 heads; docs/cuda_notes.md v46)
#ifndef ATTN_TC_BWD_MIN_BLOCKS64
#define ATTN_TC_BWD_MIN_BLOCKS64 2
#endif
#ifndef ATTN_TC_BWD_MIN_BLOCKS128
#define ATTN_TC_BWD_MIN_BLOCKS128 2
#endif
#ifndef ATTN_TC_BWD_QW64
#define ATTN_TC_BWD_QW64 64
#endif
#ifndef ATTN_TC_BWD_QW128
#define ATTN_TC_BWD_QW128 16
#endif

namespace fab {
// ---- dQ: a group per 64 query rows ------------------------------------------------------
template <class T, int D, bool RECOMPUTE>
__device__ __forceinline__ void dq_run(const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, const T* __restrict__ out,
                                       const T* __restrict__ dout, float* __restrict__ stats,
                                       float* __restrict__ drow, T* __restrict__ dq,
                                       const AttnParams& p, const AttnGrads& g,
                                       unsigned char* smem) {
  constexpr int NS = BC / 8, NO = D / 8;
  constexpr u32 TILE = 64 * D * 2;
  const u32 sq = tc::smem_u32(smem), sdo = sq + TILE, sk = sdo + TILE, sv = sk + 2 * TILE;
  float* dsm = reinterpret_cast<float*>(smem + 6 * TILE);  // each row's D
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g4 = lane >> 2, t4 = lane & 3;
  const i64 group = p.q_heads / p.kv_heads, rows_total = group * p.q_len;
  // groups (batch x KV head, row tile): every KV head's longest causal rows first
  const i64 b = blockIdx.x / p.kv_heads, kvh = blockIdx.x % p.kv_heads;
  const i64 r0 = (i64)(gridDim.y - 1 - blockIdx.y) * BR;
  const i64 R = p.batch * p.q_heads * p.q_len, base = (b * p.kv_heads + kvh) * rows_total;
  i64 k_end = p.kv_len;
  if (p.causal) {
    const i64 lim = p.kv_len - p.q_len + max_pos(r0, rows_total, p) + 1;
    k_end = k_end < lim ? k_end : lim;
  }
  const int tiles = (int)((k_end + BC - 1) / BC);
  auto load_kv = [&](int stage, int tile) {
    load_tile<D, true>(sk + stage * TILE, k, g, GK, b, kvh, (i64)tile * BC, k_end, p);
    load_tile<D, true>(sv + stage * TILE, v, g, GV, b, kvh, (i64)tile * BC, k_end, p);
  };
  load_tile<D, false>(sq, q, g, GQ, b, kvh, r0, rows_total, p);
  load_tile<D, false>(sdo, dout, g, GDO, b, kvh, r0, rows_total, p);
  if (!RECOMPUTE) load_kv(0, 0);
  tc::cp_commit();

  {  // D = dO . O: two threads a row, half of its values each
    const int r = tid >> 1, part = tid & 1;
    float d = 0.f;
    if (r0 + r < rows_total) {
      const T* o = out + row_at(g, GO, b, kvh, r0 + r, p) + part * (D / 2);
      const T* dO = dout + row_at(g, GDO, b, kvh, r0 + r, p) + part * (D / 2);
#pragma unroll
      for (int c = 0; c < D / 16; c++) {
        const uint4 x = *reinterpret_cast<const uint4*>(o + c * 8);
        const uint4 y = *reinterpret_cast<const uint4*>(dO + c * 8);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float a0, a1, b0, b1;
          tc::unpack2<T>(xs[e], a0, a1);
          tc::unpack2<T>(ys[e], b0, b1);
          d = fmaf(a0, b0, fmaf(a1, b1, d));
        }
      }
    }
    d += __shfl_xor_sync(0xffffffffu, d, 1);
    if (part == 0) {
      dsm[r] = d;
      if (r0 + r < rows_total) drow[base + r0 + r] = d;
    }
  }

  i64 lim[2];
#pragma unroll
  for (int h = 0; h < 2; h++) lim[h] = row_limit(r0 + warp * 16 + g4 + 8 * h, rows_total, p);
  const i64 lim_min = lim[0] < lim[1] ? lim[0] : lim[1];
  const float scale = p.scale, sl2 = scale * LOG2E;
  float m2[2], inv[2];  // each of the thread's two rows: max (base 2) and 1 / sum

  if (RECOMPUTE) {  // the forward's online max and sum, without its P V
    float l[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
      m2[h] = neg_inf<float>();
      l[h] = 0.f;
    }
    for (int it = 0; it < tiles; it++) {
      load_tile<D, true>(sk, k, g, GK, b, kvh, (i64)it * BC, k_end, p);
      tc::cp_commit();
      tc::cp_wait<0>();
      __syncthreads();
      float s[NS][4];
      zero(s);
      rows_dot_rows<T, D>(s, sq, warp * 16, sk, 0);
#pragma unroll
      for (int h = 0; h < 2; h++) {
        float mx = m2[h];
#pragma unroll
        for (int j = 0; j < NS; j++)
#pragma unroll
          for (int e = 0; e < 2; e++) {
            const i64 key = (i64)it * BC + j * 8 + t4 * 2 + e;
            s[j][2 * h + e] = key > lim[h] ? neg_inf<float>() : s[j][2 * h + e] * sl2;
            mx = fmaxf(mx, s[j][2 * h + e]);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float basis = mx == neg_inf<float>() ? 0.f : mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NS; j++) sum += ex2(s[j][2 * h] - basis) + ex2(s[j][2 * h + 1] - basis);
        l[h] = l[h] * ex2(m2[h] - basis) + sum;
        m2[h] = mx;
      }
      __syncthreads();  // every warp is done with the tile before it is refilled
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
      float total = l[h] + __shfl_xor_sync(0xffffffffu, l[h], 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      inv[h] = lim[h] < 0 ? 0.f : 1.f / total;
      if (lim[h] < 0) m2[h] = 0.f;
      const i64 row = r0 + warp * 16 + g4 + 8 * h;
      if (t4 == 0 && lim[h] >= 0) {
        stats[base + row] = m2[h] / LOG2E;
        stats[R + base + row] = inv[h];
      }
    }
    load_kv(0, 0);
    tc::cp_commit();
  } else {
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const i64 row = r0 + warp * 16 + g4 + 8 * h;
      const bool ok = lim[h] >= 0;
      m2[h] = ok ? stats[base + row] * LOG2E : 0.f;
      inv[h] = ok ? stats[R + base + row] : 0.f;
    }
  }

  float dq_acc[NO][4];
  zero(dq_acc);
  float drow_h[2] = {0.f, 0.f};  // each of the thread's two rows' D (read once Q has landed)
  for (int it = 0; it < tiles; it++) {
    const int stage = it & 1;
    if (it + 1 < tiles) load_kv(stage ^ 1, it + 1);
    tc::cp_commit();
    tc::cp_wait<1>();  // all but the newest group: Q, dO and tile `it` have landed
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int h = 0; h < 2; h++) drow_h[h] = dsm[warp * 16 + g4 + 8 * h];
    }
    const u32 ks = sk + stage * TILE, vs = sv + stage * TILE;
    float s[NS][4], dp[NS][4];
    zero(s);
    zero(dp);
    rows_dot_rows<T, D>(s, sq, warp * 16, ks, 0);
    rows_dot_rows<T, D>(dp, sdo, warp * 16, vs, 0);
    const i64 k0 = (i64)it * BC;
    const bool edge = k0 + BC - 1 > lim_min;
#pragma unroll
    for (int j = 0; j < NS; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int h = e >> 1;
        const i64 key = k0 + j * 8 + t4 * 2 + (e & 1);
        const float pr = edge && key > lim[h] ? 0.f : ex2(fmaf(s[j][e], sl2, -m2[h])) * inv[h];
        s[j][e] = pr * (dp[j][e] - drow_h[h]);  // dS
      }
    acc_times_rows<T, D, BC / 16>(dq_acc, s, ks, 0);
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  tc::cp_wait<0>();
  T* dst[2];
#pragma unroll
  for (int h = 0; h < 2; h++)
    dst[h] = lim[h] < 0 ? nullptr : dq + row_at(g, GDQ, b, kvh, r0 + warp * 16 + g4 + 8 * h, p);
  store_rows<T, D>(dst[0], dst[1], dq_acc, scale);
}

// ---- dK and dV: a group per 64 keys -----------------------------------------------------
template <class T, int D>
__device__ __forceinline__ void dkv_run(const T* __restrict__ q, const T* __restrict__ k,
                                        const T* __restrict__ v, const T* __restrict__ dout,
                                        const float* __restrict__ stats,
                                        const float* __restrict__ drow, T* __restrict__ dk,
                                        T* __restrict__ dv, float* __restrict__ part,
                                        const AttnParams& p, const AttnGrads& g,
                                        unsigned char* smem) {
  constexpr int QW = D == 128 ? ATTN_TC_BWD_QW128 : ATTN_TC_BWD_QW64;  // Sᵀ, dPᵀ columns
  constexpr int NQ = QW / 8, NO = D / 8;
  constexpr u32 TILE = 64 * D * 2;
  const u32 sk = tc::smem_u32(smem), sv = sk + TILE, sq = sv + TILE, sdo = sq + 2 * TILE;
  // per stage and row of the query tile: max (natural units), 1 / sum, D, last visible key
  float* info = reinterpret_cast<float*>(smem + 6 * TILE);
  const u32 info_u32 = sk + 6 * TILE;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g4 = lane >> 2, t4 = lane & 3;
  const i64 group = p.q_heads / p.kv_heads, rows_total = group * p.q_len;
  // groups (batch x KV head x part, key block): the first keys (the longest causal walks)
  // first; a part z of p.splits walks the query heads [z hs, (z + 1) hs) of the KV head's
  // group
  const i64 parts = p.splits, z = blockIdx.x % parts, bh = blockIdx.x / parts;
  const i64 b = bh / p.kv_heads, kvh = bh % p.kv_heads;
  const i64 j0 = (i64)blockIdx.y * BC;
  const i64 R = p.batch * p.q_heads * p.q_len, base = (b * p.kv_heads + kvh) * rows_total;
  const i64 hs = (group + parts - 1) / parts;
  const i64 row_begin = z * hs * p.q_len;
  const i64 row_end = min((z + 1) * hs, group) * p.q_len;
  const int n_tiles = (int)((row_end - row_begin + BR - 1) / BR);
  // the first position whose row sees key j0
  const i64 first_pos = p.causal ? j0 - (p.kv_len - p.q_len) : 0;
  auto seen = [&](int t) {
    const i64 r0 = row_begin + (i64)t * BR;
    const i64 last = min(r0 + BR, row_end) - 1;
    return ((r0 / p.q_len != last / p.q_len) ? p.q_len - 1 : last % p.q_len) >= first_pos;
  };
  auto next = [&](int t) {
    while (t < n_tiles && !seen(t)) t++;
    return t;
  };
  auto load_q = [&](int stage, int t) {
    const i64 r0 = row_begin + (i64)t * BR;
    load_tile<D, false>(sq + stage * TILE, q, g, GQ, b, kvh, r0, row_end, p);
    load_tile<D, false>(sdo + stage * TILE, dout, g, GDO, b, kvh, r0, row_end, p);
    const u32 at = info_u32 + stage * 4 * 64 * 4;
    for (int c = tid; c < 3 * 64; c += THREADS) {
      const int which = c / 64, r = c % 64;
      const bool ok = r0 + r < row_end;
      const float* src = which == 0 ? stats : which == 1 ? stats + R : drow;
      tc::cp_async4(at + (which * 64 + r) * 4, ok ? src + base + r0 + r : src, ok ? 4 : 0);
    }
    if (tid < 64)  // the last key row r0 + tid sees, plain (no global read)
      reinterpret_cast<int*>(info + stage * 4 * 64 + 3 * 64)[tid] =
          (int)row_limit(r0 + tid, row_end, p);
  };
  load_tile<D, true>(sk, k, g, GK, b, kvh, j0, p.kv_len, p);
  load_tile<D, true>(sv, v, g, GV, b, kvh, j0, p.kv_len, p);
  int cur = next(0);
  if (cur < n_tiles) load_q(0, cur);
  tc::cp_commit();

  const float scale = p.scale, sl2 = scale * LOG2E;
  float dk_acc[NO][4], dv_acc[NO][4];
  zero(dk_acc);
  zero(dv_acc);
  const i64 key_h[2] = {j0 + warp * 16 + g4, j0 + warp * 16 + g4 + 8};
  int stage = 0;
  while (cur < n_tiles) {
    const int nxt = next(cur + 1);
    if (nxt < n_tiles) load_q(stage ^ 1, nxt);
    tc::cp_commit();
    tc::cp_wait<1>();
    __syncthreads();
    const u32 qs = sq + stage * TILE, dos = sdo + stage * TILE;
    const float* m_s = info + stage * 4 * 64;
    const float* inv_s = m_s + 64;
    const float* d_s = m_s + 128;
    const int* lim_s = reinterpret_cast<const int*>(m_s + 192);
#pragma unroll
    for (int qc = 0; qc < BR / QW; qc++) {
      float s[NQ][4], dp[NQ][4];
      zero(s);
      zero(dp);
      rows_dot_rows<T, D>(s, sk, warp * 16, qs, qc * QW);
      rows_dot_rows<T, D>(dp, sv, warp * 16, dos, qc * QW);
#pragma unroll
      for (int j = 0; j < NQ; j++) {
        // this thread's two query columns: one 8-byte load of each row value
        const int col = qc * QW + j * 8 + t4 * 2;
        const float2 m = *reinterpret_cast<const float2*>(m_s + col);
        const float2 inv = *reinterpret_cast<const float2*>(inv_s + col);
        const float2 dr = *reinterpret_cast<const float2*>(d_s + col);
        const int2 lim = *reinterpret_cast<const int2*>(lim_s + col);
        const float mc[2] = {m.x * LOG2E, m.y * LOG2E}, ic[2] = {inv.x, inv.y},
                    dc[2] = {dr.x, dr.y};
        const int lc[2] = {lim.x, lim.y};
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const float pr = key_h[e >> 1] > lc[e & 1] ? 0.f
                                                     : ex2(fmaf(s[j][e], sl2, -mc[e & 1])) * ic[e & 1];
          s[j][e] = pr;
          dp[j][e] = pr * (dp[j][e] - dc[e & 1]);  // dSᵀ
        }
      }
      acc_times_rows<T, D, QW / 16>(dv_acc, s, dos, qc * QW);
      acc_times_rows<T, D, QW / 16>(dk_acc, dp, qs, qc * QW);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    cur = nxt;
    stage ^= 1;
  }
  tc::cp_wait<0>();
  if (parts > 1) {  // float32 sums: part[z][0: dK, 1: dV][b][kvh][key][D]
    const i64 n = p.batch * p.kv_heads * p.kv_len * D;
#pragma unroll
    for (int h = 0; h < 2; h++) {
      if (key_h[h] >= p.kv_len) continue;
      float* pk = part + 2 * z * n + ((b * p.kv_heads + kvh) * p.kv_len + key_h[h]) * D;
#pragma unroll
      for (int c = 0; c < NO; c++) {
        const int col = c * 8 + t4 * 2;
        *reinterpret_cast<float2*>(pk + col) =
            make_float2(dk_acc[c][2 * h] * scale, dk_acc[c][2 * h + 1] * scale);
        *reinterpret_cast<float2*>(pk + n + col) = make_float2(dv_acc[c][2 * h], dv_acc[c][2 * h + 1]);
      }
    }
    return;
  }
  T* kd[2];
  T* vd[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const bool ok = key_h[h] < p.kv_len;
    kd[h] = ok ? dk + key_at(g, GDK, b, kvh, key_h[h]) : nullptr;
    vd[h] = ok ? dv + key_at(g, GDV, b, kvh, key_h[h]) : nullptr;
  }
  store_rows<T, D>(kd[0], kd[1], dk_acc, scale);
  store_rows<T, D>(vd[0], vd[1], dv_acc, 1.f);
}

// dK and dV of a split walk: the p.splits parts' sums added in part order (deterministic),
// written through AttnGrads' strides; a thread per 4 elements of (b, kvh, key, c)
template <class T, int D>
__device__ __forceinline__ void sum_parts(const float* __restrict__ part, T* __restrict__ dk,
                                          T* __restrict__ dv, const AttnParams& p,
                                          const AttnGrads& g) {
  const int parts = (int)p.splits;
  const i64 n = p.batch * p.kv_heads * p.kv_len * D;
  for (i64 e = 4 * global_thread(); e < n; e += 4 * grid_threads()) {
    const i64 c = e % D, key = (e / D) % p.kv_len, bh = e / (D * p.kv_len);
    const i64 b = bh / p.kv_heads, kvh = bh % p.kv_heads;
    float4 sk = make_float4(0.f, 0.f, 0.f, 0.f), sv = sk;
    for (int z = 0; z < parts; z++) {
      const float4 x = *reinterpret_cast<const float4*>(part + 2 * z * n + e);
      const float4 y = *reinterpret_cast<const float4*>(part + (2 * z + 1) * n + e);
      sk = make_float4(sk.x + x.x, sk.y + x.y, sk.z + x.z, sk.w + x.w);
      sv = make_float4(sv.x + y.x, sv.y + y.y, sv.z + y.z, sv.w + y.w);
    }
    T* kd = dk + key_at(g, GDK, b, kvh, key) + c;
    T* vd = dv + key_at(g, GDV, b, kvh, key) + c;
    *reinterpret_cast<uint2*>(kd) = make_uint2(tc::pack2<T>(sk.x, sk.y), tc::pack2<T>(sk.z, sk.w));
    *reinterpret_cast<uint2*>(vd) = make_uint2(tc::pack2<T>(sv.x, sv.y), tc::pack2<T>(sv.z, sv.w));
  }
}
}  // namespace fab

// shared memory (cuda/attention.py): train (64 + 4 x 64) x D x 2; dq 6 tiles + 64 floats;
// dkv 6 tiles + 2 x 4 x 64 floats. Defined on every target so the names exist; the bodies
// need mma.sync (sm_80+), and the host uses these only on such devices (feature "mma").
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FAB_BODY(...) __VA_ARGS__
#else
#define FAB_BODY(...) __trap();
#endif
#define FAB_MIN_BLOCKS(D) ((D) == 64 ? ATTN_TC_BWD_MIN_BLOCKS64 : ATTN_TC_BWD_MIN_BLOCKS128)
// the dQ kernel, NAME dqs where it first recomputes the rows' statistics (RECOMPUTE)
#define FAB_DQ(SFX, T, D, NAME, RECOMPUTE)                                                   \
  extern "C" __global__ void __launch_bounds__(fab::THREADS, FAB_MIN_BLOCKS(D))                \
      attention_tc##D##_bwd_##NAME##_##SFX(const T* __restrict__ q, const T* __restrict__ k,  \
                                           const T* __restrict__ v, const T* __restrict__ out, \
                                           const T* __restrict__ dout,                        \
                                           float* __restrict__ stats,                         \
                                           float* __restrict__ drow, T* __restrict__ dq,      \
                                           AttnParams p, AttnGrads g) {                       \
    pdl_entry();                                                                              \
    extern __shared__ __align__(128) unsigned char smem[];                                    \
    FAB_BODY(fab::dq_run<T, D, RECOMPUTE>(q, k, v, out, dout, stats, drow, dq, p, g, smem);)  \
  }
#define FAB(SFX, T, D)                                                                        \
  extern "C" __global__ void __launch_bounds__(fab::THREADS)                                  \
      attention_tc##D##_train_##SFX(const T* __restrict__ q, const T* __restrict__ k,         \
                                    const T* __restrict__ v, T* __restrict__ out,             \
                                    float* __restrict__ stats, AttnParams p, AttnRows rows,   \
                                    KVRows kv) {                                              \
    pdl_entry();                                                                              \
    extern __shared__ __align__(128) unsigned char smem[];                                    \
    FAB_BODY(fa::run<T, D, true>(q, k, v, out, p, rows, kv, stats, smem);)                    \
  }                                                                                           \
  FAB_DQ(SFX, T, D, dq, false)                                                                \
  FAB_DQ(SFX, T, D, dqs, true)                                                                \
  extern "C" __global__ void __launch_bounds__(fab::THREADS, FAB_MIN_BLOCKS(D))                \
      attention_tc##D##_bwd_dkv_##SFX(const T* __restrict__ q, const T* __restrict__ k,       \
                                      const T* __restrict__ v, const T* __restrict__ dout,    \
                                      const float* __restrict__ stats,                        \
                                      const float* __restrict__ drow, T* __restrict__ dk,     \
                                      T* __restrict__ dv, float* __restrict__ part,           \
                                      AttnParams p, AttnGrads g) {                            \
    pdl_entry();                                                                              \
    extern __shared__ __align__(128) unsigned char smem[];                                    \
    FAB_BODY(fab::dkv_run<T, D>(q, k, v, dout, stats, drow, dk, dv, part, p, g, smem);)       \
  }                                                                                           \
  extern "C" __global__ void attention_tc##D##_sum_parts_##SFX(                               \
      const float* __restrict__ part, T* __restrict__ dk, T* __restrict__ dv, AttnParams p,   \
      AttnGrads g) {                                                                          \
    pdl_entry();                                                                              \
    fab::sum_parts<T, D>(part, dk, dv, p, g);                                                 \
  }
ONLY(f16, FAB(f16, half_t, 64))
ONLY(bf16, FAB(bf16, bf16_t, 64))
ONLY(f16, FAB(f16, half_t, 128))
ONLY(bf16, FAB(bf16, bf16_t, 128))
