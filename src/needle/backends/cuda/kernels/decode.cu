// The decode step's fused projections (numpy_ref/decode.py; docs/kernels.md, "decode"):
//   rmsnorm_gemv_*         out[j] = (W h)[j],                h = rmsnorm(x) * nw, rounded to T
//   rmsnorm_gemv_swiglu_*  out[j] = silu(g) * u,  g = (W h)[j], u = (W h)[p + j], each rounded
//   gemv_add_*             x[j] = x[j] + (W a)[j], in place (the residual stream)
// One token (a single row). W is (rows, k) as checkpoints store it; a warp streams whole rows
// with 16-byte loads that bypass L1 (ld_stream), reading x (and nw: L1-cached) in the same
// rounds, as gemv_t does. The norm needs no shared memory or barrier: each warp first sums
// x^2 (a pass over x, a few KB in L1, while its first weight loads are in flight; every warp
// in the same order, so all get the same factor), then makes h = x * r * nw rounded to T on
// the fly, exactly as rmsnorm stores it.
// Option (params.flags): FG_PREFETCH asks for the group's weight rows in L2 before waiting for
// the previous kernel (griddepcontrol.wait), since weights do not depend on it.
#include "common.cuh"
#include "tensor_core.cuh"

struct FusedGemvParams {  // gpu/array.py FUSED_GEMV
  i64 k, p, rows_per_warp;
  float eps;
  int flags;  // FG_PREFETCH
};
constexpr int FG_PREFETCH = 1;

namespace fg {
// groups of 4 warps; at least 5 groups per SM caps registers at 102 per thread, so that
// 20 warps per SM keep their loads in flight (gemv_t's occupancy; without the cap, v2's
// rounds of 8 vectors of each of w, x and nw took 171-228 registers, 2-3 groups per SM)
constexpr int MAX_THREADS = 128, MIN_GROUPS = 5;

// bytes of W from row `row` on, into L2, asynchronously (one thread)
__device__ __forceinline__ void prefetch_rows(const void* row, u64 bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const char* p = static_cast<const char*>(row);
  while (bytes) {  // the instruction takes a 32-bit size
    const u32 n = bytes > (1u << 30) ? (1u << 30) : (u32)bytes;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(n) : "memory");
    p += n;
    bytes -= n;
  }
#endif
}

// R weight rows of one warp against the vector x (times nw, for a norm), 16-byte vectors.
// A round loads U vectors of each row, of x and of nw together (as gemv_t does), so every
// load of the round is in flight at once. U keeps a round within what 96 registers hold
// (at least 5 groups per SM, gemv_t's occupancy): 8 weight vectors in flight per lane for
// gemv_add (7, with the residual), 4 for rmsnorm_gemv, 6 for the SwiGLU pair of rows.
template <class T, int R, bool NORM>
struct Rows {
  static constexpr int V = 16 / sizeof(T), U = NORM ? 12 / (R + 2) : 7;
  typedef Vec<T, V> Vt;
  Vt w[R][U], xv[U], gv[U];

  __device__ __forceinline__ void fetch(const Vt* const (&rows)[R], i64 base, i64 nv) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const i64 q = base + u * 32;
      if (q < nv) {
#pragma unroll
        for (int r = 0; r < R; r++) w[r][u] = ld_stream<T, V>(rows[r] + q);
      }
    }
  }

  __device__ __forceinline__ void fetch_x(const Vt* x, const Vt* nw, i64 base, i64 nv) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const i64 q = base + u * 32;
      if (q < nv) {
        xv[u] = x[q];
        if (NORM) gv[u] = nw[q];
      }
    }
  }

  // acc[r] = sum over k of rows[r][k] * h[k], h = x, or x * rs * nw rounded to T (the norm),
  // summed over the warp; `preloaded`: the first round of weights is already in w
  __device__ __forceinline__ void dot(const Vt* const (&rows)[R], const Vt* x, const Vt* nw,
                                     float rs, i64 nv, bool preloaded, float (&acc)[R]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (i64 base = lane; base < nv; base += 32 * U) {
      if (!(preloaded && base == lane)) fetch(rows, base, nv);
      fetch_x(x, nw, base, nv);
#pragma unroll
      for (int u = 0; u < U; u++) {
        if (base + u * 32 < nv) {
#pragma unroll
          for (int e = 0; e < V; e++) {
            float h = load(xv[u].v[e]);
            if (NORM) h = load(store<T>(h * rs * load(gv[u].v[e])));  // rmsnorm's rounding
#pragma unroll
            for (int r = 0; r < R; r++) acc[r] += load(w[r][u].v[e]) * h;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);
  }
};

// rows of this warp: [first, first + count) of p outputs
struct Span {
  i64 first, count;
  __device__ Span(const FusedGemvParams& p) {
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    first = warp * p.rows_per_warp;
    const i64 left = p.p - first;
    count = left < 0 ? 0 : (left < p.rows_per_warp ? left : p.rows_per_warp);
  }
};

// the group's rows [g0, g0 + n) of W (and, for SwiGLU, the up rows p + g0, ...) into L2
template <class T>
__device__ __forceinline__ void prefetch_group(const T* W, const FusedGemvParams& p,
                                               bool swiglu) {
  if (!(p.flags & FG_PREFETCH) || threadIdx.x != 0) return;
  const i64 per_group = (i64)(blockDim.x / 32) * p.rows_per_warp, g0 = blockIdx.x * per_group;
  const i64 n = p.p - g0 < per_group ? p.p - g0 : per_group;
  if (n <= 0) return;
  const u64 bytes = (u64)n * p.k * sizeof(T);
  prefetch_rows(W + g0 * p.k, bytes);
  if (swiglu) prefetch_rows(W + (p.p + g0) * p.k, bytes);
}

// KIND 0: rmsnorm_gemv, 1: rmsnorm_gemv_swiglu, 2: gemv_add (x is then a, and out total)
template <class T, int KIND>
__device__ __forceinline__ void fused_gemv(const T* __restrict__ x, const T* __restrict__ nw,
                                           const T* __restrict__ W, T* out,
                                           const FusedGemvParams& p) {
  typedef typename Acc<T>::type C;
  constexpr int R = KIND == 1 ? 2 : 1, V = 16 / sizeof(T);
  constexpr bool NORM = KIND != 2;
  typedef Vec<T, V> Vt;
  const i64 nv = p.k / V;
  const Span span(p);
  prefetch_group(W, p, KIND == 1);
  Rows<T, R, NORM> rows;
  pdl_entry();  // x (and total) are the previous kernels' outputs
  const Vt* xv = reinterpret_cast<const Vt*>(x);
  const Vt* gv = reinterpret_cast<const Vt*>(nw);
  auto row_ptrs = [&](i64 j, const Vt* (&row)[R]) {
#pragma unroll
    for (int r = 0; r < R; r++) row[r] = reinterpret_cast<const Vt*>(W + (j + (r ? p.p : 0)) * p.k);
  };
  float rs = 1.f;
  if (NORM && span.count) {  // the first weights in flight while the warp sums x^2
    const Vt* row[R];
    row_ptrs(span.first, row);
    rows.fetch(row, threadIdx.x & 31, nv);
    rs = warp_rms_factor<T>(x, p.k, p.eps);
  }
  for (i64 i = 0; i < span.count; i++) {
    const i64 j = span.first + i;
    const Vt* row[R];
    row_ptrs(j, row);
    // the residual's old value, asked for now so that its latency hides behind the dot
    const C before = KIND == 2 && (threadIdx.x & 31) == 0 ? (C)load(out[j]) : C(0);
    float acc[R];
    rows.dot(row, xv, gv, rs, nv, NORM && i == 0, acc);
    if ((threadIdx.x & 31) == 0) out[j] = projection_out<T, KIND>(acc[0], acc[R - 1], before);
  }
}
}  // namespace fg

#define FUSED_GEMV(SFX, T)                                                                     \
  extern "C" __global__ void __launch_bounds__(fg::MAX_THREADS, fg::MIN_GROUPS)                                \
      rmsnorm_gemv_##SFX(const T* __restrict__ x, const T* __restrict__ nw,                    \
                         const T* __restrict__ w, T* __restrict__ out, FusedGemvParams p) {    \
    fg::fused_gemv<T, 0>(x, nw, w, out, p);                                                    \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(fg::MAX_THREADS, fg::MIN_GROUPS)                                \
      rmsnorm_gemv_swiglu_##SFX(const T* __restrict__ x, const T* __restrict__ nw,             \
                                const T* __restrict__ w, T* __restrict__ out,                  \
                                FusedGemvParams p) {                                           \
    fg::fused_gemv<T, 1>(x, nw, w, out, p);                                                    \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(fg::MAX_THREADS, fg::MIN_GROUPS)                                \
      gemv_add_##SFX(const T* __restrict__ a, const T* __restrict__ w, T* total,               \
                     FusedGemvParams p) {                                                      \
    fg::fused_gemv<T, 2>(a, a, w, total, p);                                                   \
  }

ONLY(f16, FUSED_GEMV(f16, half_t))
ONLY(bf16, FUSED_GEMV(bf16, bf16_t))
ONLY(f32, FUSED_GEMV(f32, float))

// ---- attention_decode_flash_*: one token against the KV cache (numpy_ref.attention_decode) --
// Group (KV head h, split s) of G warps, warp g = query head h * G + g. The cache up to the
// position p (read on the device) is cut into S = decode_ranges(p + 1, splits, NS) equal
// ranges (common.cuh: at most splits, at least NS tiles each), one per active group, so
// that a short cache needs no merge, a long one keeps about one or two groups per SM busy,
// and the merge reads at most `splits` (<= 64) partials. A group walks its range in
// tiles of 64 positions: the whole group copies each tile's key and value rows (contiguous in
// the cache) into shared memory with 16-byte asynchronous copies, NS tiles in flight, and
// every warp scores and weighs them from there for its own query head (flash_tile: an online
// softmax in shuffles). So each row is read from memory once per group, in whole lines, and
// the copies of the next tiles overlap the work on this one. The first copies start before
// the RoPE; the group whose range holds p ropes the new key, writes key and value to the
// cache, and patches them into the staged tile (its copy may predate the write). With one
// split the group writes the output; otherwise the group that finishes last for its KV head
// merges (a counter per KV head).

namespace fd {
constexpr int TILE = FLASH_TILE;
// tiles in flight: 16 or 32 KiB each (64 KiB in float32); head size 256 (Gemma's, half
// types only) keeps two of 64 KiB, which with the warps' queries fits an A100's shared memory
template <class T, int D> struct Stages {
  static constexpr int N = sizeof(T) == 4 || D == 256 ? 2 : 3;
};

// 16 bytes global -> shared, asynchronously on sm_80+ (zeros where !live; src is not read)
__device__ __forceinline__ void copy16(void* dst, const void* src, bool live) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  tc::cp_async16(tc::smem_u32(dst), src, live ? 16 : 0);
#else
  *reinterpret_cast<uint4*>(dst) =
      live ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}
__device__ __forceinline__ void copies_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  tc::cp_commit();
#endif
}
template <int N> __device__ __forceinline__ void copies_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  tc::cp_wait<N>();
#endif
}

// rows [t0, t0 + rows) of one KV head's keys kc and values vc into ks, vs (TILE rows each;
// the rows past `rows` zero), by the whole group
template <class T, int D>
__device__ __forceinline__ void stage_tile(const T* kc, const T* vc, i64 t0, int rows, T* ks,
                                           T* vs) {
  constexpr int ROW = D * (int)sizeof(T) / 16, CH = TILE * ROW;  // 16-byte chunks
  const char* k0 = reinterpret_cast<const char*>(kc + t0 * D);
  const char* v0 = reinterpret_cast<const char*>(vc + t0 * D);
  for (int i = threadIdx.x; i < 2 * CH; i += blockDim.x) {
    const bool value = i >= CH;
    const int c = value ? i - CH : i;
    copy16(reinterpret_cast<char*>(value ? vs : ks) + c * 16, (value ? v0 : k0) + (i64)c * 16,
           c / ROW < rows);
  }
}

template <class T, int D>
__device__ __forceinline__ void flash(const T* __restrict__ qkv, const T* __restrict__ cs,
                                      const T* __restrict__ sn, const int* __restrict__ position,
                                      T* keys, T* values, float* __restrict__ part_o,
                                      float* __restrict__ part_ml, T* __restrict__ out,
                                      unsigned* counters, const DecodeParams& p, float* smem) {
  constexpr int HALF = D / 2, PER = D / 32, NS = Stages<T, D>::N;
  const int G = blockDim.x / 32, g = threadIdx.x / 32, lane = threadIdx.x % 32;
  const i64 h = blockIdx.x, s = blockIdx.y, hq = h * G + g;
  const i64 pos = position[0];
  if (pos < 0 || pos >= p.capacity || pos >= p.table_rows) {  // nothing written: NaN out
    if (s == 0)
      for (int d = lane; d < D; d += 32) out[hq * D + d] = store<T>(0.f / 0.f);
    return;
  }
  // positions lo..pos (lo: 0, or the start of a sliding window), n of them, in S ranges
  const i64 lo = window_start(pos, p.window), n = pos + 1 - lo;
  // (256-wide heads: a range may be one tile; a tile is long work for a warp a head)
  const i64 S = decode_ranges(n, p.splits, D == 256 ? 1 : NS);
  if (s >= S) return;
  const i64 per = (n + S - 1) / S, start = lo + s * per;
  const i64 end = start + per < pos + 1 ? start + per : pos + 1;
  const i64 tiles = (end - start + TILE - 1) / TILE;
  // shared memory: NS stages of (key tile, value tile), per warp its query and the tile's
  // scores (float32), then the new key and value row
  T* stages = reinterpret_cast<T*>(smem);
  float* qs = reinterpret_cast<float*>(stages + NS * 2 * TILE * D) + g * (D + TILE);
  float* sc_s = qs + D;
  T* new_kv = reinterpret_cast<T*>(reinterpret_cast<float*>(stages + NS * 2 * TILE * D) +
                                   G * (D + TILE));
  const T* kc = keys + h * p.capacity * D;
  const T* vc = values + h * p.capacity * D;
  auto rows_of = [&](i64 t) { return (int)(end - start - t * TILE < TILE ? end - start - t * TILE
                                                                         : TILE); };
  // 1. the first tiles' copies in flight while the queries are roped
#pragma unroll
  for (int t = 0; t < NS - 1; t++) {
    if (t < tiles) {
      T* st = stages + t * 2 * TILE * D;
      stage_tile<T, D>(kc, vc, start + t * TILE, rows_of(t), st, st + TILE * D);
    }
    copies_commit();
  }
  // 2. rope: the query of this warp's head; in the group holding p, warp 0 also the key,
  // written (with the value) to the cache and kept for the staged tile
  const bool holds = pos < end;
  const T* c_row = cs + pos * HALF;
  const T* s_row = sn + pos * HALF;
  for (int i = lane; i < HALF; i += 32) {
    const float c = load(c_row[i]), sv = load(s_row[i]);
    const T* x = qkv + hq * D;
    const float x1 = load(x[i]), x2 = load(x[i + HALF]);
    qs[i] = load(store<T>(x1 * c - x2 * sv));  // rounded as rope's output is
    qs[i + HALF] = load(store<T>(x2 * c + x1 * sv));
    if (holds && g == 0) {
      const T* kx = qkv + (p.q_heads + h) * D;
      const float k1 = load(kx[i]), k2 = load(kx[i + HALF]);
      const T r1 = store<T>(k1 * c - k2 * sv), r2 = store<T>(k2 * c + k1 * sv);
      keys[(h * p.capacity + pos) * D + i] = new_kv[i] = r1;
      keys[(h * p.capacity + pos) * D + i + HALF] = new_kv[i + HALF] = r2;
    }
  }
  if (holds && g == 0)
    for (int d = lane; d < D; d += 32)
      values[(h * p.capacity + pos) * D + d] = new_kv[D + d] =
          qkv[(p.q_heads + p.kv_heads + h) * D + d];
  const float scale = p.scale + p.scale_lo;
  float m = neg_inf<float>(), l = 0.f, acc[PER];
#pragma unroll
  for (int e = 0; e < PER; e++) acc[e] = 0.f;
  for (i64 t = 0; t < tiles; t++) {
    // 3. the copies of tile t + NS - 1 into the stage that tile t - 1 used (every warp left
    // it at the barrier below), then wait for tile t's
    if (t + NS - 1 < tiles) {
      T* st = stages + ((t + NS - 1) % NS) * 2 * TILE * D;
      stage_tile<T, D>(kc, vc, start + (t + NS - 1) * TILE, rows_of(t + NS - 1), st,
                       st + TILE * D);
    }
    copies_commit();
    copies_wait<NS - 1>();
    __syncthreads();  // tile t, the queries and the new row seen by the whole group
    const i64 t0 = start + t * TILE;
    const int rows = rows_of(t);
    T* ks = stages + (t % NS) * 2 * TILE * D;
    T* vs = ks + TILE * D;
    if (holds && pos < t0 + rows) {  // the same branch for the whole group
      for (int d = threadIdx.x; d < D; d += blockDim.x) {
        ks[(pos - t0) * D + d] = new_kv[d];
        vs[(pos - t0) * D + d] = new_kv[D + d];
      }
      __syncthreads();
    }
    flash_tile<T, D>(ks, vs, qs, sc_s, rows, scale, p.softcap, m, l, acc);
    __syncthreads();  // the stage is free for tile t + NS
  }
  if (S == 1) {
#pragma unroll
    for (int e = 0; e < PER; e++) out[hq * D + flash_dim<D>(lane, e)] = store<T>(acc[e] / l);
    return;
  }
  // 4. partials, then the merge in the group that finishes last for this KV head
  flash_merge<T, D>(acc, m, l, part_o, part_ml, hq * p.splits, s, S, counters + h,
                    out + hq * D);
}
}  // namespace fd

#define FLASH_DECODE(SFX, T, D)                                                                \
  extern "C" __global__ void __launch_bounds__(512)                                            \
      attention_decode_flash##D##_##SFX(DECODE_ATTENTION_PARAMS(T)) {                         \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) float fd_smem[];                                           \
    fd::flash<T, D>(qkv, cs, sn, pos, keys, values, part_o, part_ml, out, counters, p, fd_smem); \
  }
#define FLASH_DECODE_ALL(SFX, T) FLASH_DECODE(SFX, T, 64) FLASH_DECODE(SFX, T, 128)
#define FLASH_DECODE_HALF(SFX, T) FLASH_DECODE_ALL(SFX, T) FLASH_DECODE(SFX, T, 256)
ONLY(f16, FLASH_DECODE_HALF(f16, half_t))
ONLY(bf16, FLASH_DECODE_HALF(bf16, bf16_t))
ONLY(f32, FLASH_DECODE_ALL(f32, float))
