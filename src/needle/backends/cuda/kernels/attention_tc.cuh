// nn.cu's attention_tc{64,128}_{f16,bf16} (FlashAttention-2 on tensor cores, sm_80+);
// included by nn.cu only.
#pragma once
#include "common.cuh"
#include "attention.cuh"
#include "tensor_core.cuh"

// ---- attention on tensor cores: float16/bfloat16, head_dim 64 or 128 (sm_80+) ----------
// The FlashAttention-2 schedule. A group of 4 warps owns 64 query rows of one (batch, kv
// head), numbered as in attn::run (row r: query head kv_head*group + r / q_len, position
// r % q_len); each warp owns 16 of them. 64-key tiles of K and V stream through two
// shared-memory stages by cp.async while the previous tile is used. S = Q Kᵀ and O += P V
// run on mma.sync m16n8k16 with fp32 accumulators; P never leaves registers (the S
// accumulators of two n8 tiles are the A fragment of one k16 step of P V). The softmax is
// online, in base 2, with each row's max and sum kept by the 4 lanes that hold the row.
// Shared tiles are [rows][D] with 16-byte chunk c of row r at c ^ (r & 7) (conflict-free
// ldmatrix). Keys past the causal limit or kv_len score -inf; K and V rows past the last
// key the group can see are zero-filled, never read.
//
// Where q's and out's rows live: AttnRows (attention.cuh), a by-value argument after the
// params; K's and V's: KVRows (heads-first caches for nn.cu's kernels, a training step's
// token-major projections for attention_tc_bwd.cu's). STATS: each row's max score (natural
// units) and 1 / sum of exponentials also go to stats[(b * kv_heads + kv_head) * rows + r]
// and R = batch * q_heads * q_len floats further, for the backward.

namespace fa {
constexpr int BR = 64, BC = 64, THREADS = 128;

using tc::ex2;
using tc::swz;

template <class T, int D, bool STATS = false>
__device__ __forceinline__ void run(const T* __restrict__ q, const T* __restrict__ k,
                                    const T* __restrict__ v, T* __restrict__ out,
                                    const AttnParams& p, const AttnRows& rows, const KVRows& kvr,
                                    float* __restrict__ stats, unsigned char* smem) {
  constexpr int CH = D / 8, KD = D / 16, NS = BC / 8, NO = D / 8;
  constexpr u32 Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;
  const u32 sq = tc::smem_u32(smem), sk = sq + Q_BYTES, sv = sk + 2 * KV_BYTES;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const i64 group = p.q_heads / p.kv_heads, rows_total = group * p.q_len;
  const i64 b = blockIdx.y / p.kv_heads, kvh = blockIdx.y % p.kv_heads;
  const i64 r0 = (i64)(gridDim.x - 1 - blockIdx.x) * BR;  // the longest causal rows start first
  const i64 kv_len = p.kv_len;

  // keys this group can see: [0, k_end)
  const i64 last = r0 + BR - 1 < rows_total ? r0 + BR - 1 : rows_total - 1;
  const i64 max_pos = (r0 / p.q_len != last / p.q_len) ? p.q_len - 1 : last % p.q_len;
  i64 k_end = kv_len;
  if (p.causal) {
    const i64 lim = kv_len - p.q_len + max_pos + 1;
    k_end = k_end < lim ? k_end : lim;
  }
  const int tiles = (int)((k_end + BC - 1) / BC);
  const int tile0 = (int)(attn_first_key(p, r0, last) / BC);  // a sliding window's first tile

#pragma unroll
  for (int i = 0; i < BR * CH / THREADS; i++) {
    const int c = tid + i * THREADS, r = c / CH, ch = c % CH;
    const i64 row = r0 + r;
    const bool ok = row < rows_total;
    const T* src = q;
    if (ok) {
      const i64 hq = kvh * group + row / p.q_len, pos = row % p.q_len;
      src = q + b * rows.q_batch + hq * rows.q_head + pos * rows.q_pos + ch * 8;
    }
    tc::cp_async16(sq + swz<D>(r, ch), src, ok ? 16 : 0);
  }
  const T* kbase = k + b * kvr.k_batch + kvh * kvr.k_head;
  const T* vbase = v + b * kvr.v_batch + kvh * kvr.v_head;
  auto load_kv = [&](int stage, int tile) {
    const u32 ks = sk + stage * KV_BYTES, vs = sv + stage * KV_BYTES;
#pragma unroll
    for (int i = 0; i < BC * CH / THREADS; i++) {
      const int c = tid + i * THREADS, j = c / CH, ch = c % CH;
      const i64 key = (i64)tile * BC + j;
      const bool ok = key < k_end;
      const i64 ko = ok ? key * kvr.k_pos + ch * 8 : 0, vo = ok ? key * kvr.v_pos + ch * 8 : 0;
      tc::cp_async16(ks + swz<D>(j, ch), kbase + ko, ok ? 16 : 0);
      tc::cp_async16(vs + swz<D>(j, ch), vbase + vo, ok ? 16 : 0);
    }
  };
  if (tile0 < tiles) load_kv(0, tile0);
  tc::cp_commit();  // group 0: Q and the first K/V tile

  // the last key each of this thread's two rows (g, g + 8 of the warp's 16) may see
  // (and with a sliding window the first)
  i64 lim[2], lo[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const i64 row = r0 + warp * 16 + g + 8 * h;
    lim[h] = kv_len - 1;
    if (p.causal && row < rows_total) lim[h] = kv_len - p.q_len + row % p.q_len;
    lo[h] = p.causal && p.window > 0 ? lim[h] - p.window + 1 : 0;
  }
  const i64 lim_min = lim[0] < lim[1] ? lim[0] : lim[1];
  const i64 lo_max = lo[0] > lo[1] ? lo[0] : lo[1];
  const float sl2 = p.scale * 1.4426950408889634f;  // scores in base-2 exponent units

  u32 qf[KD][4];
  float o[NO][4], m[2], l[2];
#pragma unroll
  for (int n = 0; n < NO; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) o[n][e] = 0.f;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    m[h] = neg_inf<float>();
    l[h] = 0.f;
  }

  for (int it = tile0; it < tiles; it++) {
    const int stage = (it - tile0) & 1;
    if (it + 1 < tiles) load_kv(stage ^ 1, it + 1);
    tc::cp_commit();
    tc::cp_wait<1>();  // all but the newest group: Q and tile `it` have landed
    __syncthreads();
    if (it == tile0) {
#pragma unroll
      for (int kd = 0; kd < KD; kd++)
        tc::ldsm_x4(sq + swz<D>(warp * 16 + (lane & 15), kd * 2 + (lane >> 4)), qf[kd]);
    }
    const u32 ks = sk + stage * KV_BYTES, vs = sv + stage * KV_BYTES;

    float s[NS][4];
#pragma unroll
    for (int j = 0; j < NS; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[j][e] = 0.f;
#pragma unroll
    for (int kd = 0; kd < KD; kd++) {
#pragma unroll
      for (int np = 0; np < NS / 2; np++) {
        // keys np*16 + 0..7 (lanes 0-15) and + 8..15 (lanes 16-31); d chunk 2kd or 2kd+1
        u32 t[4];
        tc::ldsm_x4(ks + swz<D>(np * 16 + ((lane >> 4) << 3) + (lane & 7),
                                kd * 2 + ((lane >> 3) & 1)), t);
        tc::Mma<T>::run(s[2 * np], qf[kd], t[0], t[1]);
        tc::Mma<T>::run(s[2 * np + 1], qf[kd], t[2], t[3]);
      }
    }

    const i64 k0 = (i64)it * BC;
    const bool edge = k0 + BC - 1 > lim_min || k0 < lo_max;
#pragma unroll
    for (int j = 0; j < NS; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        s[j][e] *= sl2;
        const i64 key = k0 + j * 8 + t4 * 2 + (e & 1);
        if (edge && (key > lim[e >> 1] || key < lo[e >> 1])) s[j][e] = neg_inf<float>();
      }

#pragma unroll
    for (int h = 0; h < 2; h++) {
      float mx = m[h];
#pragma unroll
      for (int j = 0; j < NS; j++) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == neg_inf<float>() ? 0.f : mx;  // nothing visible yet
      const float alpha = ex2(m[h] - base);
      m[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < NS; j++) {
        s[j][2 * h] = ex2(s[j][2 * h] - base);
        s[j][2 * h + 1] = ex2(s[j][2 * h + 1] - base);
        sum += s[j][2 * h] + s[j][2 * h + 1];
      }
      l[h] = l[h] * alpha + sum;  // this thread's columns only; the row's 4 lanes sum at the end
#pragma unroll
      for (int n = 0; n < NO; n++) {
        o[n][2 * h] *= alpha;
        o[n][2 * h + 1] *= alpha;
      }
    }

#pragma unroll
    for (int kc = 0; kc < BC / 16; kc++) {
      const u32 a[4] = {tc::pack2<T>(s[2 * kc][0], s[2 * kc][1]),
                        tc::pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                        tc::pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                        tc::pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int np = 0; np < NO / 2; np++) {
        u32 t[4];
        tc::ldsm_x4_t(vs + swz<D>(kc * 16 + (lane & 15), np * 2 + (lane >> 4)), t);
        tc::Mma<T>::run(o[2 * np], a, t[0], t[1]);
        tc::Mma<T>::run(o[2 * np + 1], a, t[2], t[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  tc::cp_wait<0>();

  float total[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    total[h] = l[h] + __shfl_xor_sync(0xffffffffu, l[h], 1);
    total[h] += __shfl_xor_sync(0xffffffffu, total[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const i64 row = r0 + warp * 16 + g + 8 * h;
    if (row >= rows_total) continue;
    const i64 hq = kvh * group + row / p.q_len, pos = row % p.q_len;
    T* dst = out + b * rows.o_batch + hq * rows.o_head + pos * rows.o_pos + t4 * 2;
    const float inv = 1.f / total[h];
    if (STATS && t4 == 0) {  // m in base-2 units back to natural ones
      const i64 at = (b * p.kv_heads + kvh) * rows_total + row;
      stats[at] = m[h] * 0.6931471805599453f;
      stats[p.batch * p.q_heads * p.q_len + at] = inv;
    }
#pragma unroll
    for (int n = 0; n < NO; n++)
      *reinterpret_cast<u32*>(dst + n * 8) = tc::pack2<T>(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
  }
}
}  // namespace fa
