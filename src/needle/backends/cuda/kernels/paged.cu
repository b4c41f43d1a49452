// Paged attention (docs/kernels.md, "paged"; numpy_ref/paged.py is the specification).
// paged_write: one group per token copies its key and value rows into their pool slot.
// paged_attention: one group of 128 threads per (token, query head) walks the sequence's
// positions 0..p in chunks of 128 through its block table: a thread per position scores
// q·k, the group takes the chunk's max and sum of exp (online softmax), and threads over
// head_dim accumulate p·V. Scores and sums in C (float, double for f64).
#include "common.cuh"

struct PagedWriteParams { i64 tokens, row, num_slots; };
struct PagedParams {
  i64 tokens, q_heads, kv_heads, head_dim, page_size, max_pages, num_pages;
  float scale;
};

namespace paged {
constexpr int THREADS = 128;  // the launch's group size (gpu/paged.py)
constexpr int MAX_D = 256;

template <class T>
__device__ void write(const T* __restrict__ k, const T* __restrict__ v,
                      const int* __restrict__ slots, T* kp, T* vp, const PagedWriteParams& p) {
  const i64 t = blockIdx.x, s = slots[t];
  if (s < 0 || s >= p.num_slots) return;
  for (i64 i = threadIdx.x; i < p.row; i += blockDim.x) {
    kp[s * p.row + i] = k[t * p.row + i];
    vp[s * p.row + i] = v[t * p.row + i];
  }
}

template <class C, bool MAX>
__device__ __forceinline__ C group_reduce(C v, C* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const C w = __shfl_xor_sync(0xffffffffu, v, o);
    v = MAX ? (w > v ? w : v) : v + w;
  }
  __syncthreads();  // red may still be read from the previous reduction
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < THREADS / 32; w++) v = MAX ? (red[w] > v ? red[w] : v) : v + red[w];
  return v;
}

template <class T, class C>
__device__ void attend(const T* __restrict__ q, const T* __restrict__ kp,
                       const T* __restrict__ vp, const int* __restrict__ tables,
                       const int* __restrict__ seq_of, const int* __restrict__ positions,
                       T* __restrict__ out, const PagedParams& p) {
  __shared__ C qs[MAX_D];
  __shared__ C ps[THREADS];
  __shared__ i64 slot_s[THREADS];
  __shared__ C red[THREADS / 32];
  __shared__ int bad;
  const i64 t = blockIdx.x, h = blockIdx.y, D = p.head_dim;
  const i64 kh = h / (p.q_heads / p.kv_heads), row = p.kv_heads * D;
  const int tid = threadIdx.x;
  const i64 pos = positions[t];
  const int* table = tables + (i64)seq_of[t] * p.max_pages;
  T* o = out + (t * p.q_heads + h) * D;
  if (tid == 0) bad = pos < 0 || pos / p.page_size >= p.max_pages;
  __syncthreads();
  if (!bad)
    for (i64 j = tid; j <= pos / p.page_size; j += THREADS)
      if (table[j] < 0 || table[j] >= p.num_pages) bad = 1;
  __syncthreads();
  if (bad) {  // kernels cannot raise: NaN, as numpy_ref gives
    for (i64 i = tid; i < D; i += THREADS) o[i] = store<T>(C(0) / C(0));
    return;
  }
  for (i64 i = tid; i < D; i += THREADS) qs[i] = (C)load(q[(t * p.q_heads + h) * D + i]);
  C acc[MAX_D / THREADS] = {};
  C m = neg_inf<C>(), l = 0;
  const C scale = (C)p.scale;
  __syncthreads();
  for (i64 c0 = 0; c0 <= pos; c0 += THREADS) {
    const i64 j = c0 + tid;
    C s = neg_inf<C>();
    if (j <= pos) {
      const i64 slot = (i64)table[j / p.page_size] * p.page_size + j % p.page_size;
      const T* kr = kp + slot * row + kh * D;
      C dot = 0;
      for (i64 i = 0; i < D; i++) dot += qs[i] * (C)load(kr[i]);
      s = dot * scale;
      slot_s[tid] = slot;
    }
    const C mn = group_reduce<C, true>(s > m ? s : m, red);
    const C e = j <= pos ? m_exp(s - mn) : (C)0;
    ps[tid] = e;
    const C corr = m_exp(m - mn);
    l = l * corr + group_reduce<C, false>(e, red);  // its barriers publish ps and slot_s
    m = mn;
    const int n = (int)(pos - c0 + 1 < THREADS ? pos - c0 + 1 : THREADS);
#pragma unroll
    for (int u = 0; u < MAX_D / THREADS; u++) {
      const i64 i = tid + u * THREADS;
      if (i < D) {
        C a = acc[u] * corr;
        for (int r = 0; r < n; r++) a += ps[r] * (C)load(vp[slot_s[r] * row + kh * D + i]);
        acc[u] = a;
      }
    }
    __syncthreads();  // ps and slot_s are rewritten by the next chunk
  }
#pragma unroll
  for (int u = 0; u < MAX_D / THREADS; u++) {
    const i64 i = tid + u * THREADS;
    if (i < D) o[i] = store<T>(acc[u] / l);
  }
}
}  // namespace paged

#define PAGED(SFX, T, C)                                                                       \
  extern "C" __global__ void paged_write_##SFX(const T* __restrict__ k, const T* __restrict__ v, \
                                               const int* __restrict__ slots, T* kp, T* vp,     \
                                               PagedWriteParams p) {                            \
    pdl_entry();                                                                               \
    paged::write<T>(k, v, slots, kp, vp, p);                                                   \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(paged::THREADS)                                 \
      paged_attention_##SFX(const T* __restrict__ q, const T* __restrict__ kp,                 \
                            const T* __restrict__ vp, const int* __restrict__ tables,          \
                            const int* __restrict__ seq_of, const int* __restrict__ positions, \
                            T* __restrict__ out, PagedParams p) {                              \
    pdl_entry();                                                                               \
    paged::attend<T, C>(q, kp, vp, tables, seq_of, positions, out, p);                         \
  }

ONLY(f16, PAGED(f16, half_t, float))
ONLY(bf16, PAGED(bf16, bf16_t, float))
ONLY(f32, PAGED(f32, float, float))
ONLY(f64, PAGED(f64, double, double))
