// The gradients of float32 attention with head_dim 64 (docs/kernels.md,
// "attention_backward"): attention_simt64_stats_f32 and attention_simt64_bwd_f32.
//
// The composed backward (ops_nn.ScaledDotProductAttention.gradient) writes the (s, s) scores,
// probabilities and their gradients to memory and runs five batched products over them, with
// q, k, v and the output gradient copied heads-first first: for a GPT step's causal
// (16, 8, 256, 64) attention that is ~0.4 ms a layer on an H100. Here, as FlashAttention-2's
// backward does, nothing of size (s, s) leaves the chip:
//  * stats (only where the forward kept none: attention_simt64_train_f32 writes the same): a
//    group of 256 threads a 64-row tile of queries (numbered as attention_simt.cu: row r of
//    a KV head is query head kv_head * group + r / q_len at position r % q_len) recomputes
//    each row's running max m and 1 / l over the keys, as the forward kernel does.
//  * bwd: a group of 256 threads owns 64 keys of one (batch, KV head), keeps K and V in shared
//    memory and dK, dV in registers, and walks the query tiles that can see its keys: per
//    tile each row's D = dO . O (from the half-warp that loads the row), S = Q Kᵀ and
//    dP = dO Vᵀ (each thread 4 rows x 4 keys, keys tx + 16 c), P = exp(S -
//    m) / l, dS = P (dP - D); then dV += Pᵀ dO, dK += dSᵀ Q (Q held scaled, so the scale is
//    in) and the tile's share of dQ = scale dS K (each thread 4 keys or rows x 4 columns).
//    dQ sums over key blocks: with one block it is written; with several each block writes
//    its share to its own slab (zeros for tiles it cannot see) and the host sums the slabs in
//    block order, so the result does not depend on which group finishes first.
// Every row is read and written through its (batch, head, position) strides (AttnGrads), so
// token-major projections need no heads-first copies.
#include "common.cuh"
#include "attention.cuh"
#include "attention_simt.cuh"

// tuning knob (NEEDLE_CUDA_OPTIONS): groups an SM the backward is compiled for (2 caps its
// registers at 128)
#ifndef ATTN_BWD_MIN_BLOCKS
#define ATTN_BWD_MIN_BLOCKS 2
#endif
// how far the one-row-a-step loops (dV, dQ) unroll: 4 keeps 128 registers with no spill
// (8 spills); H100, (16, 8, 256, 64) causal: 1: 202 us, 2: 195, 4: 187 (docs/cuda_notes.md v20)
#ifndef ATTN_BWD_UNROLL
#define ATTN_BWD_UNROLL 4
#endif


namespace abwd {
// bwd's shared memory (cuda/attention.py's _ATTN_BWD_SHARED): K, V, Q, dO and dSᵀ tiles
// [64][LD], P [64][PLD], 4 values a row of the tile
constexpr int BR = 64, BC = 64, D = 64, THREADS = 256, LD = D + 4, PLD = BC + 16;
using simt::dot4, simt::half_warp_max, simt::half_warp_sum, simt::ld4, simt::outer4,
    simt::rows4_times4, simt::st4;

__device__ __forceinline__ void row_dots(const float* A, const float* B, int ty, int tx,
                                         float (&s)[4][4]) {
  simt::row_dots<D, LD, 1>(A, B, ty, tx, s);
}

// a row r of KV head kvh: its query head and position
template <class T>
__device__ __forceinline__ T* row_ptr(T* base, const AttnGrads& g, int x, i64 b, i64 kvh, i64 r,
                                      const AttnParams& p) {
  const i64 group = p.q_heads / p.kv_heads;
  return base + b * g.s[x][0] + (kvh * group + r / p.q_len) * g.s[x][1] + (r % p.q_len) * g.s[x][2];
}
// the last key row r may see (-1: a row past the end)
__device__ __forceinline__ int row_limit(i64 r, i64 rows_total, const AttnParams& p) {
  return (int)(r >= rows_total ? -1 : p.causal ? p.kv_len - p.q_len + r % p.q_len : p.kv_len - 1);
}
// the largest position among rows [r0, r0 + BR)
__device__ __forceinline__ i64 max_pos(i64 r0, i64 rows_total, const AttnParams& p) {
  const i64 last = r0 + BR - 1 < rows_total ? r0 + BR - 1 : rows_total - 1;
  return (r0 / p.q_len != last / p.q_len) ? p.q_len - 1 : last % p.q_len;
}
// rows j0 .. j0 + 63 of a K or V head into shared memory [64][LD], zeros past `rows`
__device__ __forceinline__ void load_keys(float* S, const float* base, i64 stride, int j0,
                                          int rows) {
#pragma unroll
  for (int i = 0; i < BC * D / 4 / THREADS; i++) {
    const int c = threadIdx.x + i * THREADS, j = c / (D / 4), d = (c % (D / 4)) * 4;
    st4(S + j * LD + d, j0 + j < rows ? ld4(base + (i64)(j0 + j) * stride + d)
                                      : make_float4(0.f, 0.f, 0.f, 0.f));
  }
}

// Each row's m and 1 / l (stats[0..R) and [R..2R), row index (b * kv_heads + kvh) *
// rows_total + r), as attention_simt64_train_f32 writes them with its output.
__device__ __forceinline__ void stats(const float* __restrict__ q, const float* __restrict__ k,
                                      float* __restrict__ st, const AttnParams& p,
                                      const AttnGrads& g) {
  __shared__ __align__(16) float Qs[BR * LD];
  __shared__ __align__(16) float Ks[BC * LD];
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const i64 group = p.q_heads / p.kv_heads, rows_total = group * p.q_len;
  const i64 b = blockIdx.y / p.kv_heads, kvh = blockIdx.y % p.kv_heads;
  const i64 r0 = (i64)blockIdx.x * BR;
  const float scale = p.scale + p.scale_lo;
  i64 k_end = p.kv_len;
  if (p.causal) {
    const i64 lim = p.kv_len - p.q_len + max_pos(r0, rows_total, p) + 1;
    k_end = k_end < lim ? k_end : lim;
  }
#pragma unroll
  for (int i = 0; i < BR * D / 4 / THREADS; i++) {
    const int c = tid + i * THREADS, r = c / (D / 4), d = (c % (D / 4)) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r0 + r < rows_total) {
      x = ld4(row_ptr(q, g, GQ, b, kvh, r0 + r, p) + d);
      x = make_float4(x.x * scale, x.y * scale, x.z * scale, x.w * scale);
    }
    st4(Qs + r * LD + d, x);
  }
  float m[4], l[4];
  int limit[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    m[i] = neg_inf<float>();
    l[i] = 0.f;
    limit[i] = row_limit(r0 + ty + 16 * i, rows_total, p);
  }
  const float* kbase = k + b * g.s[GK][0] + kvh * g.s[GK][1];
  const int keys = (int)k_end;
  for (int kt = 0; kt < keys; kt += BC) {
    __syncthreads();
    load_keys(Ks, kbase, g.s[GK][2], kt, keys);
    __syncthreads();
    float s[4][4];
    row_dots(Qs, Ks, ty, tx, s);
#pragma unroll
    for (int i = 0; i < 4; i++) {  // the online max and sum, as attention_simt.cu's
      float mt = neg_inf<float>();
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const int key = kt + tx + 16 * c;
        if (key >= keys || key > limit[i]) s[i][c] = neg_inf<float>();
        mt = fmaxf(mt, s[i][c]);
      }
      const float mn = fmaxf(m[i], half_warp_max(mt));
      const bool seen = mn != neg_inf<float>();
      const float alpha = m[i] == neg_inf<float>() ? 0.f : m_exp(m[i] - mn);
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < 4; c++)
        sum += (!seen || s[i][c] == neg_inf<float>()) ? 0.f : m_exp(s[i][c] - mn);
      l[i] = l[i] * alpha + half_warp_sum(sum);
      m[i] = mn;
    }
  }
  const i64 R = p.batch * p.q_heads * p.q_len, base = (b * p.kv_heads + kvh) * rows_total;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const i64 r = r0 + ty + 16 * i;
    if (r < rows_total && tx == 0) {
      st[base + r] = m[i];
      st[R + base + r] = 1.f / l[i];
    }
  }
}

__device__ __forceinline__ void bwd(const float* __restrict__ q, const float* __restrict__ k,
                                    const float* __restrict__ v, const float* __restrict__ out,
                                    const float* __restrict__ dout,
                                    const float* __restrict__ st, float* __restrict__ dq,
                                    float* __restrict__ dk, float* __restrict__ dv,
                                    const AttnParams& p, const AttnGrads& g, float* smem) {
  float* Ks = smem;             // [BC][LD]
  float* Vs = Ks + BC * LD;     // [BC][LD]
  float* Qs = Vs + BC * LD;     // [BR][LD], scaled
  float* Os = Qs + BR * LD;     // [BR][LD]: dO
  float* Ts = Os + BR * LD;     // [BC][LD]: dSᵀ (key-major)
  float* Ps = Ts + BC * LD;     // [BR][PLD]: P (row-major)
  float* Ms = Ps + BR * PLD;    // per row of the tile: m, 1 / l, D, last visible key
  float* Ls = Ms + BR;
  float* Dd = Ls + BR;
  int* Lim = reinterpret_cast<int*>(Dd + BR);
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const i64 group = p.q_heads / p.kv_heads, rows_total = group * p.q_len;
  const i64 b = blockIdx.y / p.kv_heads, kvh = blockIdx.y % p.kv_heads;
  const int j0 = blockIdx.x * BC;
  const float scale = p.scale + p.scale_lo;
  const i64 R = p.batch * p.q_heads * p.q_len, sbase = (b * p.kv_heads + kvh) * rows_total;
  float* dq_blk = dq + blockIdx.x * g.dq_slab;
  // the first position that sees key j0 (causal): earlier rows skip this block
  const i64 first_pos = p.causal ? j0 - (p.kv_len - p.q_len) : 0;

  load_keys(Ks, k + b * g.s[GK][0] + kvh * g.s[GK][1], g.s[GK][2], j0, (int)p.kv_len);
  load_keys(Vs, v + b * g.s[GV][0] + kvh * g.s[GV][1], g.s[GV][2], j0, (int)p.kv_len);

  float dka[4][4], dva[4][4];  // keys j0 + 4 ty + i, columns 4 tx + c
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int c = 0; c < 4; c++) dka[i][c] = dva[i][c] = 0.f;

  for (i64 r0 = 0; r0 < rows_total; r0 += BR) {
    if (max_pos(r0, rows_total, p) < first_pos) {  // no row sees these keys: dQ's share is 0
      if (g.dq_slab) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const i64 r = r0 + 4 * ty + i;
          if (r < rows_total)
            st4(row_ptr(dq_blk, g, GDQ, b, kvh, r, p) + 4 * tx, make_float4(0.f, 0.f, 0.f, 0.f));
        }
      }
      continue;
    }
    __syncthreads();  // the last tile's products are done with Qs, Os, Ps, Ts
    // Q (scaled) and dO into shared memory; each row's D = dO . O from the 16 lanes (a
    // half-warp) that load it
#pragma unroll
    for (int i = 0; i < BR * D / 4 / THREADS; i++) {
      const int c = tid + i * THREADS, r = c / (D / 4), d = (c % (D / 4)) * 4;
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f), o = x;
      float dd = 0.f;
      if (r0 + r < rows_total) {
        x = ld4(row_ptr(q, g, GQ, b, kvh, r0 + r, p) + d);
        x = make_float4(x.x * scale, x.y * scale, x.z * scale, x.w * scale);
        o = ld4(row_ptr(dout, g, GDO, b, kvh, r0 + r, p) + d);
        dd = dot4(o, ld4(row_ptr(out, g, GO, b, kvh, r0 + r, p) + d), 0.f);
      }
      dd = half_warp_sum(dd);
      if (d == 0) Dd[r] = dd;
      st4(Qs + r * LD + d, x);
      st4(Os + r * LD + d, o);
    }
    if (tid < BR) {
      const i64 r = r0 + tid;
      const bool ok = r < rows_total;
      Ms[tid] = ok ? st[sbase + r] : 0.f;
      Ls[tid] = ok ? st[R + sbase + r] : 0.f;
      Lim[tid] = row_limit(r, rows_total, p);
    }
    __syncthreads();

    // S = Q Kᵀ, then P into shared memory (rows ty + 16 i, keys j0 + tx + 16 c), then
    // dP = dO Vᵀ and dS = P (dP - D) with the thread's own P read back (no barrier needed):
    // s and dp are never live together (128 registers, two groups an SM)
    {
      float s[4][4];
      row_dots(Qs, Ks, ty, tx, s);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int row = ty + 16 * i, lim = Lim[row];
        const float mi = Ms[row], li = Ls[row];
#pragma unroll
        for (int c = 0; c < 4; c++) {
          const int key = j0 + tx + 16 * c;
          Ps[row * PLD + tx + 16 * c] =
              key <= lim && key < p.kv_len ? m_exp(s[i][c] - mi) * li : 0.f;
        }
      }
    }
    {
      float dp[4][4];
      row_dots(Os, Vs, ty, tx, dp);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int row = ty + 16 * i;
        const float di = Dd[row];
#pragma unroll
        for (int c = 0; c < 4; c++)
          Ts[(tx + 16 * c) * LD + row] = Ps[row * PLD + tx + 16 * c] * (dp[i][c] - di);
      }
    }
    __syncthreads();

    // dV += Pᵀ dO and dK += dSᵀ Q: keys 4 ty + i, columns 4 tx + c
#pragma unroll ATTN_BWD_UNROLL
    for (int r = 0; r < BR; r++) {
      outer4(dva, ld4(Ps + r * PLD + 4 * ty), ld4(Os + r * LD + 4 * tx));
    }
#pragma unroll 1
    for (int r = 0; r < BR; r += 4) {
      float4 ta[4], qb[4];
#pragma unroll
      for (int i = 0; i < 4; i++) ta[i] = ld4(Ts + (4 * ty + i) * LD + r);
#pragma unroll
      for (int rr = 0; rr < 4; rr++) qb[rr] = ld4(Qs + (r + rr) * LD + 4 * tx);
      rows4_times4(dka, ta, qb);
    }
    // this block's share of dQ = scale dS K: rows 4 ty + i, columns 4 tx + c
    float dqa[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int c = 0; c < 4; c++) dqa[i][c] = 0.f;
#pragma unroll ATTN_BWD_UNROLL
    for (int j = 0; j < BC; j++) {
      outer4(dqa, ld4(Ts + j * LD + 4 * ty), ld4(Ks + j * LD + 4 * tx));
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const i64 r = r0 + 4 * ty + i;
      if (r < rows_total)
        st4(row_ptr(dq_blk, g, GDQ, b, kvh, r, p) + 4 * tx,
            make_float4(dqa[i][0] * scale, dqa[i][1] * scale, dqa[i][2] * scale,
                        dqa[i][3] * scale));
    }
  }

#pragma unroll
  for (int i = 0; i < 4; i++) {
    const int key = j0 + 4 * ty + i;
    if (key >= p.kv_len) continue;
    st4(dk + b * g.s[GDK][0] + kvh * g.s[GDK][1] + key * g.s[GDK][2] + 4 * tx,
        make_float4(dka[i][0], dka[i][1], dka[i][2], dka[i][3]));
    st4(dv + b * g.s[GDV][0] + kvh * g.s[GDV][1] + key * g.s[GDV][2] + 4 * tx,
        make_float4(dva[i][0], dva[i][1], dva[i][2], dva[i][3]));
  }
}
}  // namespace abwd

ONLY(f32, extern "C" __global__ void __launch_bounds__(abwd::THREADS)
              attention_simt64_stats_f32(const float* __restrict__ q,
                                         const float* __restrict__ k,
                                         float* __restrict__ stats, AttnParams p,
                                         AttnGrads g) {
                pdl_entry();
                abwd::stats(q + g.off[GQ], k + g.off[GK], stats, p, g);
              })

ONLY(f32, extern "C" __global__ void __launch_bounds__(abwd::THREADS, ATTN_BWD_MIN_BLOCKS)
              attention_simt64_bwd_f32(const float* __restrict__ q, const float* __restrict__ k,
                                       const float* __restrict__ v,
                                       const float* __restrict__ out,
                                       const float* __restrict__ dout,
                                       const float* __restrict__ stats,
                                       float* __restrict__ dq, float* __restrict__ dk,
                                       float* __restrict__ dv, AttnParams p, AttnGrads g) {
                pdl_entry();
                extern __shared__ __align__(16) float smem[];
                abwd::bwd(q + g.off[GQ], k + g.off[GK], v + g.off[GV], out + g.off[GO],
                          dout + g.off[GDO], stats,
                          dq + g.off[GDQ], dk + g.off[GDK], dv + g.off[GDV], p, g, smem);
              })
