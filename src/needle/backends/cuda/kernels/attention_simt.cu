// float32 attention as tiled products on the FP32 pipes (docs/kernels.md, "attention_simt"):
// attention_simt64_f32, head_dim 64, for prefill- and training-sized queries.
//
// nn.cu's attention_f32 gives each warp 4 query rows and each lane one key of a 32-key tile
// (a dot product of 64 terms a lane, then a shuffle per key to spread P): 226 µs for a GPT
// step's causal (16, 8, 256, 64) attention on an H100, where PyTorch's memory-efficient
// kernel takes 73. Here a group of 256 threads (16 x 16) owns 64 query rows of one (batch,
// kv head), numbered as nn.cu's (row r: query head kv_head * group + r / q_len, position
// r % q_len), and streams 64-key tiles of K and V through shared memory. Each thread holds
// a 4 x 4 block of S = Q Kᵀ (rows ty + 16 i, keys tx + 16 c) and of O (rows ty + 16 i,
// columns 4 tx .. 4 tx + 3), so both products are register-tiled outer products: per four
// steps of d (or of keys) 8 float4 shared loads feed 64 multiply-adds. The softmax is
// online; a row's 64 scores sit in the 16 lanes of one half-warp (shuffles over xor 8, 4,
// 2, 1). P goes through shared memory between the products. Keys past the causal limit or
// kv_len score -inf; rows past the end are computed on zeros and not stored.
//
// Shared rows are padded to 68 floats (K's 16 rows a load then fill each bank once) and P's
// to 80 (the two rows a warp writes fall in different banks).
#include "common.cuh"
#include "attention.cuh"
#include "attention_simt.cuh"

// tuning knob (NEEDLE_CUDA_OPTIONS): how far the products' loops unroll. Not at all: 128
// registers, two groups an SM (H100, (16, 8, 256, 64) causal: 83-86 us); 4: 150 registers,
// one group an SM, 90 us (docs/cuda_notes.md v18)
#ifndef ATTN_SIMT_UNROLL
#define ATTN_SIMT_UNROLL 1
#endif

namespace asimt {
constexpr int BR = 64, BC = 64, D = 64, THREADS = 256, LD = D + 4, PLD = BC + 16;
constexpr int SHARED_FLOATS = (BR + 2 * BC) * LD + BR * PLD;

using simt::dot4, simt::half_warp_max, simt::half_warp_sum, simt::ld4, simt::rows4_times4,
    simt::st4;

using KVRows = ::KVRows;  // attention.cuh

// STATS: also each row's max score and 1 / sum of exponentials, for the backward
// (attention_simt_bwd.cu reads them: stats[(b * kv_heads + kv_head) * rows + r] and R
// floats further, R = batch * q_heads * q_len)
template <bool STATS>
__device__ __forceinline__ void run(const float* __restrict__ q, const float* __restrict__ k,
                                    const float* __restrict__ v, float* __restrict__ out,
                                    float* __restrict__ stats, const AttnParams& p,
                                    const AttnRows& rows, const KVRows& kv, float* smem) {
  float* Qs = smem;           // [BR][LD], scaled
  float* Ks = Qs + BR * LD;   // [BC][LD]
  float* Vs = Ks + BC * LD;   // [BC][LD]
  float* Ps = Vs + BC * LD;   // [BR][PLD]
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const i64 group = p.q_heads / p.kv_heads, rows_total = group * p.q_len;
  const i64 b = blockIdx.y / p.kv_heads, kvh = blockIdx.y % p.kv_heads;
  const i64 r0 = (i64)(gridDim.x - 1 - blockIdx.x) * BR;  // the longest causal rows first
  const float scale = p.scale + p.scale_lo;

  // keys this group can see: [0, k_end)
  const i64 last = r0 + BR - 1 < rows_total ? r0 + BR - 1 : rows_total - 1;
  const i64 max_pos = (r0 / p.q_len != last / p.q_len) ? p.q_len - 1 : last % p.q_len;
  i64 k_end = p.kv_len;
  if (p.causal) {
    const i64 lim = p.kv_len - p.q_len + max_pos + 1;
    k_end = k_end < lim ? k_end : lim;
  }

#pragma unroll
  for (int i = 0; i < BR * D / 4 / THREADS; i++) {  // the Q tile, 4 float4 a thread
    const int c = tid + i * THREADS, r = c / (D / 4), d = (c % (D / 4)) * 4;
    const i64 row = r0 + r;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row < rows_total) {
      const i64 hq = kvh * group + row / p.q_len, pos = row % p.q_len;
      x = ld4(q + b * rows.q_batch + hq * rows.q_head + pos * rows.q_pos + d);
      x = make_float4(x.x * scale, x.y * scale, x.z * scale, x.w * scale);
    }
    st4(Qs + r * LD + d, x);
  }

  float m[4], l[4], o[4][4];
  int limit[4];  // each row's last visible key (keys counted in int: kv_len < 2^31)
#pragma unroll
  for (int i = 0; i < 4; i++) {
    m[i] = neg_inf<float>();
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) o[i][j] = 0.f;
    const i64 row = r0 + ty + 16 * i;
    limit[i] = (int)(row >= rows_total ? -1
                     : p.causal ? p.kv_len - p.q_len + row % p.q_len : p.kv_len - 1);
  }

  const float* kbase = k + b * kv.k_batch + kvh * kv.k_head;
  const float* vbase = v + b * kv.v_batch + kvh * kv.v_head;
  const int keys = (int)k_end;
  for (int kt = 0; kt < keys; kt += BC) {
    __syncthreads();  // the last tile's P V is done with Vs and Ps (and Qs is stored)
#pragma unroll
    for (int i = 0; i < BC * D / 4 / THREADS; i++) {
      const int c = tid + i * THREADS, j = c / (D / 4), d = (c % (D / 4)) * 4;
      const bool ok = kt + j < keys;
      const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
      st4(Ks + j * LD + d, ok ? ld4(kbase + (i64)(kt + j) * kv.k_pos + d) : zero);
      st4(Vs + j * LD + d, ok ? ld4(vbase + (i64)(kt + j) * kv.v_pos + d) : zero);
    }
    __syncthreads();

    float s[4][4];
    simt::row_dots<D, LD, ATTN_SIMT_UNROLL>(Qs, Ks, ty, tx, s);

#pragma unroll
    for (int i = 0; i < 4; i++) {  // the online softmax of row ty + 16 i
      float mt = neg_inf<float>();
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const int key = kt + tx + 16 * c;
        if (key >= keys || key > limit[i]) s[i][c] = neg_inf<float>();
        mt = fmaxf(mt, s[i][c]);
      }
      const float mn = fmaxf(m[i], half_warp_max(mt));
      const bool seen = mn != neg_inf<float>();  // some key visible so far
      const float alpha = m[i] == neg_inf<float>() ? 0.f : m_exp(m[i] - mn);
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const float pc = (!seen || s[i][c] == neg_inf<float>()) ? 0.f : m_exp(s[i][c] - mn);
        Ps[(ty + 16 * i) * PLD + tx + 16 * c] = pc;
        sum += pc;
      }
      l[i] = l[i] * alpha + half_warp_sum(sum);
      m[i] = mn;
#pragma unroll
      for (int j = 0; j < 4; j++) o[i][j] *= alpha;
    }
    __syncthreads();

#pragma unroll ATTN_SIMT_UNROLL
    for (int j = 0; j < BC; j += 4) {  // O += P V
      float4 pa[4], vb[4];
#pragma unroll
      for (int i = 0; i < 4; i++) pa[i] = ld4(Ps + (ty + 16 * i) * PLD + j);
#pragma unroll
      for (int jj = 0; jj < 4; jj++) vb[jj] = ld4(Vs + (j + jj) * LD + tx * 4);
      rows4_times4(o, pa, vb);
    }
  }

#pragma unroll
  for (int i = 0; i < 4; i++) {
    const i64 row = r0 + ty + 16 * i;
    if (row >= rows_total) continue;
    const i64 hq = kvh * group + row / p.q_len, pos = row % p.q_len;
    const float inv = 1.f / l[i];
    st4(out + b * rows.o_batch + hq * rows.o_head + pos * rows.o_pos + tx * 4,
        make_float4(o[i][0] * inv, o[i][1] * inv, o[i][2] * inv, o[i][3] * inv));
    if (STATS && tx == 0) {
      const i64 at = (b * p.kv_heads + kvh) * rows_total + row;
      stats[at] = m[i];
      stats[p.batch * p.q_heads * p.q_len + at] = inv;
    }
  }
}
}  // namespace asimt

ONLY(f32, extern "C" __global__ void __launch_bounds__(asimt::THREADS)
              attention_simt64_f32(const float* __restrict__ q, const float* __restrict__ k,
                                   const float* __restrict__ v, float* __restrict__ out,
                                   AttnParams p, AttnRows rows) {
                pdl_entry();
                extern __shared__ __align__(16) float smem[];
                const i64 head = p.kv_capacity * asimt::D;  // heads-first caches
                const asimt::KVRows kv = {p.kv_heads * head, head, asimt::D,
                                          p.kv_heads * head, head, asimt::D};
                asimt::run<false>(q, k, v, out, nullptr, p, rows, kv, smem);
              })

// the same with each row's max and 1 / sum written to stats (capability attention_backward's
// attention_with_stats: a training step's forward, whose backward then skips its stats pass),
// K and V read where KVRows says (a model's token-major projections: no heads-first copies)
ONLY(f32, extern "C" __global__ void __launch_bounds__(asimt::THREADS)
              attention_simt64_train_f32(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, float* __restrict__ out,
                                         float* __restrict__ stats, AttnParams p,
                                         AttnRows rows, asimt::KVRows kv) {
                pdl_entry();
                extern __shared__ __align__(16) float smem[];
                asimt::run<true>(q, k, v, out, stats, p, rows, kv, smem);
              })
