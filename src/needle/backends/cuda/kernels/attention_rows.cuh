// nn.cu's attention_* and attention_combine_* (flash-style tiles on CUDA cores, any dtype
// and head_dim <= 256); included by nn.cu only.
#pragma once
#include "common.cuh"
#include "attention.cuh"

// ---- attention ----------------------------------------------------------------------------
// Group: 32 query rows of one (batch, kv head) x 32-key tiles. Each of the 8 warps owns 4
// rows; lane j scores key j of the tile against the 4 rows together, then the warp folds the
// tile into each row's running max / sum / output (lanes over head_dim, 8 values each,
// head_dim <= 256), every K and V value read from shared memory once for the 4 rows (a row
// at a time took 402 us for a GPT step's causal float32 attention on an H100, 226 now).
namespace attn {
constexpr int ROWS = 32, KEYS = 32, WARPS = 8, RPW = ROWS / WARPS, DPL = 8;

template <class T, class C>
__device__ __forceinline__ void run(const T* __restrict__ q, const T* __restrict__ k,
                                    const T* __restrict__ v, T* __restrict__ out,
                                    float* __restrict__ part_o, float* __restrict__ part_ml,
                                    const AttnParams& p, unsigned char* smem_raw) {
  const int D = (int)p.head_dim, lane = threadIdx.x, warp = threadIdx.y;
  const int tid = warp * 32 + lane;
  C* Qs = reinterpret_cast<C*>(smem_raw);
  C* Ks = Qs + ROWS * D;
  C* Vs = Ks + KEYS * (D + 1);
  const i64 group = p.q_heads / p.kv_heads, rows_total = group * p.q_len;
  const i64 b = blockIdx.y / p.kv_heads, kvh = blockIdx.y % p.kv_heads;
  const i64 r0 = (i64)blockIdx.x * ROWS;
  const i64 split = blockIdx.z;

  for (int idx = tid; idx < ROWS * D; idx += WARPS * 32) {
    const int r = idx / D, d = idx % D;
    const i64 row = r0 + r;
    C val = C(0);
    if (row < rows_total) {
      const i64 hq = kvh * group + row / p.q_len, pos = row % p.q_len;
      val = (C)load(q[((b * p.q_heads + hq) * p.q_len + pos) * D + d]) * ((C)p.scale + (C)p.scale_lo);
    }
    Qs[r * D + d] = val;
  }

  const i64 last = (r0 + ROWS - 1 < rows_total ? r0 + ROWS - 1 : rows_total - 1);
  const i64 max_pos = (r0 / p.q_len != last / p.q_len) ? p.q_len - 1 : last % p.q_len;
  const i64 k_first = attn_first_key(p, r0, last);  // a sliding window's earliest key
  const i64 k_begin = split * p.chunk > k_first ? split * p.chunk : k_first;
  i64 k_end = split * p.chunk + p.chunk < p.kv_len ? split * p.chunk + p.chunk : p.kv_len;
  if (p.causal) {
    const i64 lim = p.kv_len - p.q_len + max_pos + 1;
    k_end = k_end < lim ? k_end : lim;
  }

  C m[RPW], l[RPW], o[RPW][DPL];
  i64 limit[RPW], first[RPW];
#pragma unroll
  for (int i = 0; i < RPW; i++) {
    m[i] = neg_inf<C>();
    l[i] = C(0);
#pragma unroll
    for (int c = 0; c < DPL; c++) o[i][c] = C(0);
    const i64 row = r0 + warp * RPW + i;
    limit[i] = p.causal ? p.kv_len - p.q_len + row % p.q_len : p.kv_len - 1;
    first[i] = p.causal && p.window > 0 ? limit[i] - p.window + 1 : 0;
  }

  const T* kbase = k + (b * p.kv_heads + kvh) * p.kv_capacity * D;
  const T* vbase = v + (b * p.kv_heads + kvh) * p.kv_capacity * D;
  for (i64 kt = k_begin; kt < k_end; kt += KEYS) {
    __syncthreads();
    for (int idx = tid; idx < KEYS * D; idx += WARPS * 32) {
      const int j = idx / D, d = idx % D;
      const bool ok = kt + j < k_end;
      Ks[j * (D + 1) + d] = ok ? (C)load(kbase[(kt + j) * D + d]) : C(0);
      Vs[j * D + d] = ok ? (C)load(vbase[(kt + j) * D + d]) : C(0);
    }
    __syncthreads();
    const i64 key = kt + lane;
    // scores of key `lane` against the warp's RPW rows together: the key's value at d read
    // once for all rows (one row at a time read each key value RPW times: the loop was
    // bound by shared-memory loads, two a multiply-add)
    C s[RPW], pj[RPW];
    bool live[RPW];
#pragma unroll
    for (int i = 0; i < RPW; i++) s[i] = C(0);
    const C* kr = Ks + lane * (D + 1);
    const C* qw = Qs + warp * RPW * D;
    for (int d = 0; d < D; d++) {
      const C kd = kr[d];
#pragma unroll
      for (int i = 0; i < RPW; i++) s[i] += qw[i * D + d] * kd;
    }
#pragma unroll
    for (int i = 0; i < RPW; i++) {  // online softmax of each row (warp-uniform branches)
      pj[i] = C(0);
      live[i] = r0 + warp * RPW + i < rows_total;
      if (!live[i]) continue;
      s[i] = soft_cap(s[i], p.softcap);  // q was scaled: s is the scaled score
      if (key >= k_end || key > limit[i] || key < first[i]) s[i] = neg_inf<C>();
      const C mt = warp_max(s[i]);
      const C mn = m[i] > mt ? m[i] : mt;
      live[i] = mn != neg_inf<C>();  // nothing visible yet: the row's state stays
      if (!live[i]) continue;
      pj[i] = s[i] == neg_inf<C>() ? C(0) : m_exp(s[i] - mn);
      const C alpha = m[i] == neg_inf<C>() ? C(0) : m_exp(m[i] - mn);
      l[i] = l[i] * alpha + warp_sum(pj[i]);
      m[i] = mn;
#pragma unroll
      for (int c = 0; c < DPL; c++) o[i][c] *= alpha;
    }
    // O += P V for the rows together: each value of V read once for all rows
    for (int j = 0; j < KEYS; j++) {
      C pk[RPW];
#pragma unroll
      for (int i = 0; i < RPW; i++) pk[i] = __shfl_sync(0xffffffffu, pj[i], j);
      const C* vr = Vs + j * D;
#pragma unroll
      for (int c = 0; c < DPL; c++) {
        if (32 * c >= D) break;  // uniform
        const int d = lane + 32 * c;
        const C vv = d < D ? vr[d] : C(0);
#pragma unroll
        for (int i = 0; i < RPW; i++)
          if (live[i]) o[i][c] += pk[i] * vv;
      }
    }
  }

#pragma unroll
  for (int i = 0; i < RPW; i++) {
    const i64 row = r0 + warp * RPW + i;
    if (row >= rows_total) continue;
    const i64 hq = kvh * group + row / p.q_len, pos = row % p.q_len;
    const i64 orow = (b * p.q_heads + hq) * p.q_len + pos;
    if (p.splits == 1) {
      const C inv = C(1) / l[i];
#pragma unroll
      for (int c = 0; c < DPL; c++) {
        const int d = lane + 32 * c;
        if (d < D) out[orow * D + d] = store<T>((typename Acc<T>::type)(o[i][c] * inv));
      }
    } else {
      const i64 slot = orow * p.splits + split;
#pragma unroll
      for (int c = 0; c < DPL; c++) {
        const int d = lane + 32 * c;
        if (d < D) part_o[slot * D + d] = (float)o[i][c];
      }
      if (lane == 0) {
        part_ml[slot * 2] = (float)m[i];
        part_ml[slot * 2 + 1] = (float)l[i];
      }
    }
  }
}

// merge the splits of one output row (a warp per row)
template <class T>
__device__ __forceinline__ void combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        T* __restrict__ out, const AttnParams& p) {
  const i64 rows = p.batch * p.q_heads * p.q_len;
  const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int D = (int)p.head_dim;
  float mx = neg_inf<float>();
  for (i64 s = 0; s < p.splits; s++) {
    const float ms = part_ml[(row * p.splits + s) * 2];
    mx = ms > mx ? ms : mx;
  }
  float acc[DPL], total = 0.f;
#pragma unroll
  for (int c = 0; c < DPL; c++) acc[c] = 0.f;
  for (i64 s = 0; s < p.splits; s++) {
    const i64 slot = row * p.splits + s;
    const float ls = part_ml[slot * 2 + 1];
    if (ls == 0.f) continue;
    const float wgt = expf(part_ml[slot * 2] - mx);
    total += ls * wgt;
#pragma unroll
    for (int c = 0; c < DPL; c++) {
      const int d = threadIdx.x + 32 * c;
      if (d < D) acc[c] += part_o[slot * D + d] * wgt;
    }
  }
#pragma unroll
  for (int c = 0; c < DPL; c++) {
    const int d = threadIdx.x + 32 * c;
    if (d < D) out[row * D + d] = store<T>((typename Acc<T>::type)(acc[c] / total));
  }
}
}  // namespace attn
