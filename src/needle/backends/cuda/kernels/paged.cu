// Paged attention (docs/kernels.md, "paged"; numpy_ref/paged.py is the specification).
// paged_write: one group per token copies its key and value rows into their pool slot.
// paged_attention: one group of 128 threads per (token, query head) walks the sequence's
// positions 0..p in chunks of 128 through its block table: a thread per position scores
// q·k, the group takes the chunk's max and sum of exp (online softmax), and threads over
// head_dim accumulate p·V. Scores and sums in C (float, double for f64).
// paged_attention_flash{64,128} (and 256 in half types: Gemma's heads): the serving path's
// kernel (at most 16 query heads per KV head): flash decoding through the block table, below.
#include "common.cuh"

struct PagedWriteParams { i64 tokens, row, num_slots; };
struct PagedParams {
  i64 tokens, q_heads, kv_heads, head_dim, page_size, max_pages, num_pages;
  float scale;
  int window;     // a sliding window (positions p - window + 1..p), 0: none
  float softcap;  // scores soft-capped (Gemma 2: common.cuh soft_cap), 0: none
};
struct PagedFlashParams {  // gpu/paged.py PAGED_FLASH
  i64 tokens, q_heads, kv_heads, page_size, max_pages, num_pages, splits;
  float scale;
  int window;
  float softcap;
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
  const i64 t = blockIdx.x, h = blockIdx.y, D = p.head_dim;
  const i64 kh = h / (p.q_heads / p.kv_heads), row = p.kv_heads * D;
  const int tid = threadIdx.x;
  const i64 pos = positions[t];
  const int* table = tables + (i64)seq_of[t] * p.max_pages;
  T* o = out + (t * p.q_heads + h) * D;
  // every thread checks the position itself, then its share of the block table, and
  // __syncthreads_or tells all (no shared flag written by several threads at once)
  bool bad = pos < 0 || pos / p.page_size >= p.max_pages;
  if (!bad)
    for (i64 j = tid; j <= pos / p.page_size; j += THREADS)
      if (table[j] < 0 || table[j] >= p.num_pages) bad = true;
  if (__syncthreads_or(bad)) {  // kernels cannot raise: NaN, as numpy_ref gives
    for (i64 i = tid; i < D; i += THREADS) o[i] = store<T>(C(0) / C(0));
    return;
  }
  for (i64 i = tid; i < D; i += THREADS) qs[i] = (C)load(q[(t * p.q_heads + h) * D + i]);
  C acc[MAX_D / THREADS] = {};
  C m = neg_inf<C>(), l = 0;
  const C scale = (C)p.scale;
  __syncthreads();
  for (i64 c0 = window_start(pos, p.window); c0 <= pos; c0 += THREADS) {
    const i64 j = c0 + tid;
    C s = neg_inf<C>();
    if (j <= pos) {
      const i64 slot = (i64)table[j / p.page_size] * p.page_size + j % p.page_size;
      const T* kr = kp + slot * row + kh * D;
      C dot = 0;
      for (i64 i = 0; i < D; i++) dot += qs[i] * (C)load(kr[i]);
      s = soft_cap(dot * scale, p.softcap);
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

// ---- paged_attention_flash{D}: group (token t, KV head h, split s) of G warps, warp g for
// query head h * G + g (the group's query heads share every key and value row it loads,
// through L1). Positions 0..p of token t are cut into S = min(splits, ceil((p + 1) / 64))
// ranges, one per active group; a group walks its range in tiles of 64 positions with an
// online softmax: the group stages the tile's key and value rows (found through the block
// table) in shared memory, each warp scores them with D / 8 lanes per row (16-byte reads),
// then lane l holds positions l and l + 32 for the softmax and owns dims l, l + 32, ... for
// p·V, the probabilities passed by shuffle. With S = 1 the group writes the output;
// otherwise it leaves float32 partials and the group that finishes last for (t, h) merges
// (one counter per (t, h), left at zero). Every group checks the whole block-table row, so
// a bad page id gives the whole query NaN, as numpy_ref does.
namespace pf {
constexpr int TILE = FLASH_TILE;

template <class T, int D>
__device__ __forceinline__ void flash(const T* __restrict__ q, const T* __restrict__ kp,
                                      const T* __restrict__ vp, const int* __restrict__ tables,
                                      const int* __restrict__ seq_of,
                                      const int* __restrict__ positions, float* __restrict__ part_o,
                                      float* __restrict__ part_ml, T* __restrict__ out,
                                      unsigned* counters, const PagedFlashParams& p, float* smem) {
  constexpr int PER = D / 32;
  const int G = blockDim.x / 32, g = threadIdx.x / 32, lane = threadIdx.x % 32;
  const i64 t = blockIdx.x, h = blockIdx.y, s = blockIdx.z, hq = h * G + g;
  const i64 pos = positions[t], row = p.kv_heads * D, ps = p.page_size;
  const int* table = tables + (i64)seq_of[t] * p.max_pages;
  T* o = out + (t * p.q_heads + hq) * D;
  bool bad = pos < 0 || pos / ps >= p.max_pages;
  if (!bad)
    for (i64 j = threadIdx.x; j <= pos / ps; j += blockDim.x)
      if (table[j] < 0 || table[j] >= p.num_pages) bad = true;
  if (__syncthreads_or(bad)) {  // kernels cannot raise: NaN, as numpy_ref gives
    if (s == 0)
      for (int d = lane; d < D; d += 32) o[d] = store<T>(0.f / 0.f);
    return;
  }
  // positions lo..pos (lo: 0, or the start of a sliding window), n of them, in S ranges
  const i64 lo = window_start(pos, p.window), n = pos + 1 - lo;
  const i64 S = p.splits < (n + TILE - 1) / TILE ? p.splits : (n + TILE - 1) / TILE;
  if (s >= S) return;
  const i64 per = (n + S - 1) / S, start = lo + s * per;
  const i64 end = start + per < pos + 1 ? start + per : pos + 1;
  // shared memory: the tile's keys and values (64 rows of D), its slots, then per warp its
  // query and the tile's scores. The group stages each tile once (16-byte copies, whole
  // lines); its G warps, one per query head, read it from there, not from L2 G times.
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + TILE * D;
  int* slot_s = reinterpret_cast<int*>(vs + TILE * D);
  float* qs = reinterpret_cast<float*>(slot_s + TILE) + g * (D + TILE);
  float* sc_s = qs + D;
  for (int i = lane; i < D; i += 32) qs[i] = load(q[(t * p.q_heads + hq) * D + i]);
  const float scale = p.scale;
  const T* kh = kp + h * D;
  const T* vh = vp + h * D;
  constexpr int V = 16 / sizeof(T), LPR = D / V;  // 16-byte chunks per row
  float m = neg_inf<float>(), l = 0.f, acc[PER];
#pragma unroll
  for (int e = 0; e < PER; e++) acc[e] = 0.f;
  for (i64 t0 = start; t0 < end; t0 += TILE) {
    const int rows = end - t0 < TILE ? (int)(end - t0) : TILE;
    __syncthreads();  // every warp is done with the previous tile
    for (int j = threadIdx.x; j < TILE; j += blockDim.x)  // a pool holds < 2^31 slots
      slot_s[j] = j < rows ? (int)(table[(t0 + j) / ps] * ps + (t0 + j) % ps) : -1;
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * TILE * LPR; i += blockDim.x) {
      const int value = i >= TILE * LPR, r = (i / LPR) % TILE, c = i % LPR, sl = slot_s[r];
      uint4 chunk = make_uint4(0u, 0u, 0u, 0u);
      if (sl >= 0) chunk = *reinterpret_cast<const uint4*>((value ? vh : kh) + (i64)sl * row + c * V);
      *reinterpret_cast<uint4*>((value ? vs : ks) + r * D + c * V) = chunk;
    }
    __syncthreads();
    flash_tile<T, D>(ks, vs, qs, sc_s, rows, scale, p.softcap, m, l, acc);
  }
  if (S == 1) {
#pragma unroll
    for (int e = 0; e < PER; e++) o[flash_dim<D>(lane, e)] = store<T>(acc[e] / l);
    return;
  }
  flash_merge<T, D>(acc, m, l, part_o, part_ml, (t * p.q_heads + hq) * p.splits, s, S,
                    counters + t * p.kv_heads + h, o);
}
}  // namespace pf

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

#define PAGED_FLASH(SFX, T, D)                                                                 \
  extern "C" __global__ void __launch_bounds__(512, 1)                                            \
      paged_attention_flash##D##_##SFX(                                                        \
          const T* __restrict__ q, const T* __restrict__ kp, const T* __restrict__ vp,         \
          const int* __restrict__ tables, const int* __restrict__ seq_of,                      \
          const int* __restrict__ positions, float* __restrict__ part_o,                       \
          float* __restrict__ part_ml, T* __restrict__ out, unsigned* counters,                \
          PagedFlashParams p) {                                                                \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) float pf_smem[];                                           \
    pf::flash<T, D>(q, kp, vp, tables, seq_of, positions, part_o, part_ml, out, counters, p,   \
                    pf_smem);                                                                  \
  }
#define PAGED_FLASH_ALL(SFX, T) PAGED_FLASH(SFX, T, 64) PAGED_FLASH(SFX, T, 128)
#define PAGED_FLASH_HALF(SFX, T) PAGED_FLASH_ALL(SFX, T) PAGED_FLASH(SFX, T, 256)

ONLY(f16, PAGED_FLASH_HALF(f16, half_t))
ONLY(bf16, PAGED_FLASH_HALF(bf16, bf16_t))
ONLY(f32, PAGED_FLASH_ALL(f32, float))
ONLY(f16, PAGED(f16, half_t, float))
ONLY(bf16, PAGED(bf16, bf16_t, float))
ONLY(f32, PAGED(f32, float, float))
ONLY(f64, PAGED(f64, double, double))
