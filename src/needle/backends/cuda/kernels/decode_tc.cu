// attention_decode_tc{64,128}_{f16,bf16}: one token against the KV cache on tensor cores
// (numpy_ref.attention_decode; sm_80+). The G <= 16 query heads of a KV head are the 16 rows
// of one mma.sync m16n8k16 A operand (rows past G are zeros), so a 64-position tile costs a
// warp 2 * D / 16 * 2 mma for its 16 keys instead of ~1000 scalar instructions per head:
// flash_tile's scalar loops made long caches instruction-bound (docs/cuda_notes.md v11).
//
// Group (KV head h, split s) of 4 warps; the cache up to the position p is cut into
// S = decode_ranges(p + 1, splits, NS) ranges (common.cuh) as in attention_decode_flash. The
// group stages each 64-position tile of keys and values in shared memory (cp.async, NS
// tiles in flight, swizzled for ldmatrix); warp w scores keys 16w..16w+15 of every tile
// (S = Q Kᵀ), keeps an online softmax (base 2) for the 16 rows and adds P V (P from the
// score registers, as FlashAttention-2 does). Then the 4 warps' states are merged through shared memory into the
// group's (m, l, o) per head; with one split the group writes the output, otherwise it leaves
// float32 partials and the group that finishes last for its KV head merges them.
// The group whose range holds p ropes the new key, writes key and value to the cache and
// patches them into the staged tile (its copy may predate the write).
#include "cluster.cuh"
#include "common.cuh"
#include "tensor_core.cuh"

// attention_decode_tc{64,128}c_{f16,bf16} (sm_90, for caches of at most CLUSTER ranges a KV
// head): the KV head's ranges are one cluster, whose groups leave their (m, l, o) in shared
// memory and whose first group merges them through distributed shared memory, with no
// partials in global memory, count or last group (docs/cuda_notes.md v39). A cluster launch
// with 32 ranges measured ~0.7 us slower, so longer caches take the kernel above. A
// cluster's range may be a single tile (S = decode_ranges(p + 1, splits, 1), the host's
// splits at most CLUSTER): at positions 300-640 the kernel took ~1.2 us less than with at
// least NS tiles a range (v40).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DTC_HAS_CLUSTER 1
#else
#define DTC_HAS_CLUSTER 0
#endif

namespace dtc {
constexpr int TILE = 64, WARPS = 4, ROWS = 16;
#if DTC_HAS_CLUSTER
constexpr int CLUSTER = 8;  // the most ranges a KV head the ...c kernels take
#endif

template <class T, int D>
struct Smem {  // byte offsets into the dynamic shared memory; NS tiles in flight (64 KiB)
  static constexpr int NS = D == 64 ? 4 : 2;
  static constexpr u32 Q = 0, KV = ROWS * D * 2, STAGE = 2 * TILE * D * 2;
  static constexpr u32 NEW = KV + NS * STAGE, BYTES = NEW + 2 * D * 2;
  // after the loop, over the stages: per warp per row (m, l) then o[D], then the merge
  // weights of the partials (16 rows x 64)
  static constexpr u32 ML = KV, O = ML + WARPS * ROWS * 2 * 4, W = O + WARPS * ROWS * D * 4;
  // the group's own (m, l) per head, then o per head, read by its cluster's first group
  static constexpr u32 GML = W + ROWS * 64 * 4, GO = GML + ROWS * 2 * 4;
  static_assert(GO + ROWS * D * 4 <= NEW, "the merge fits over the stages");
};

// rows [t0, t0 + rows) of keys kc and values vc (contiguous rows of D) into the swizzled
// stage at byte offset st (keys, then values), zeros past `rows`
template <class T, int D>
__device__ __forceinline__ void stage_tile(const T* kc, const T* vc, i64 t0, int rows, u32 st) {
  constexpr int CH = D / 8;
  for (int i = threadIdx.x; i < TILE * CH; i += blockDim.x) {
    const int r = i / CH, ch = i % CH;
    const bool live = r < rows;
    const i64 off = live ? (t0 + r) * D + ch * 8 : 0;
    tc::cp_async16(st + tc::swz<D>(r, ch), kc + off, live ? 16 : 0);
    tc::cp_async16(st + TILE * D * 2 + tc::swz<D>(r, ch), vc + off, live ? 16 : 0);
  }
}

// Step 9 of run (below): the last group of KV head h merges its G heads' S partials
// (part_o: float32 o per head and range; part_ml: the range's (max, sum) in base-2 units).
// A thread per (head, 4 dims): LG = D / 4 threads a head (16 or 32), within one warp, so
// the weights are a warp's shuffles and its own rows of wts (shared: 128 floats a warp).
template <class T, int D>
__device__ __forceinline__ void merge_partials(const float* part_o, const float* part_ml,
                                               T* out, i64 h, int G, i64 S, i64 splits,
                                               int lane, int warp, float* wts) {
  constexpr int LG = D / 4, PM = 64 / LG, B = 16;  // S <= 64: PM statistics a lane
  static_assert(LG == 16 || LG == 32, "a head's threads are a half or a whole warp");
  for (int base = warp * 32; base < G * LG; base += WARPS * 32) {  // uniform per warp
    const int i = base + lane, r = i / LG, c = i % LG;
    const bool live = r < G;
    float* ws = wts + warp * 128 + (lane / LG) * 64;  // this head's weights
    const i64 row = (h * G + (live ? r : 0)) * splits;  // this head's first partial
    float mi[PM], li[PM];
#pragma unroll
    for (int k = 0; k < PM; k++) {
      const int j = c + LG * k;
      mi[k] = live && j < S ? __ldcg(part_ml + (row + j) * 2) : neg_inf<float>();
      li[k] = live && j < S ? __ldcg(part_ml + (row + j) * 2 + 1) : 0.f;
    }
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i0 = 0; i0 < S; i0 += B) {
      float4 v[B];
#pragma unroll
      for (int u = 0; u < B; u++)
        v[u] = live && i0 + u < S
                   ? __ldcg(reinterpret_cast<const float4*>(part_o + (row + i0 + u) * D) + c)
                   : make_float4(0.f, 0.f, 0.f, 0.f);
      if (i0 == 0) {  // the weights, while the partials are on their way
        float mm = mi[0];
#pragma unroll
        for (int k = 1; k < PM; k++) mm = fmaxf(mm, mi[k]);
#pragma unroll
        for (int x = LG / 2; x > 0; x >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, x));
        float wk[PM], total = 0.f;
#pragma unroll
        for (int k = 0; k < PM; k++) {
          wk[k] = c + LG * k < S ? tc::ex2(mi[k] - mm) : 0.f;  // (a dead head: 0 / 0, unused)
          total += li[k] * wk[k];
        }
#pragma unroll
        for (int x = LG / 2; x > 0; x >>= 1) total += __shfl_xor_sync(0xffffffffu, total, x);
#pragma unroll
        for (int k = 0; k < PM; k++) ws[c + LG * k] = wk[k] / total;
        __syncwarp();
      }
#pragma unroll
      for (int u = 0; u < B; u++) {
        const float w = i0 + u < S ? ws[i0 + u] : 0.f;
        acc[0] += w * v[u].x;
        acc[1] += w * v[u].y;
        acc[2] += w * v[u].z;
        acc[3] += w * v[u].w;
      }
    }
    if (live) {
      T* o = out + (h * G + r) * D + 4 * c;
#pragma unroll
      for (int k = 0; k < 4; k++) o[k] = store<T>(acc[k]);
    }
    __syncwarp();  // wts rewritten by this warp's next heads
  }
}

#if DTC_HAS_CLUSTER
// The cluster's first group merges the `live` groups' states (L::GML, L::GO of each, after a
// cl::sync) into the output: a thread per (head, 4 dims), every remote load issued
// before any is used.
template <class T, int D, int CL>
__device__ __forceinline__ void merge_cluster(u32 base, int live, T* out, i64 h, int G) {
  typedef Smem<T, D> L;
  constexpr int LG = D / 4;
  for (int i = threadIdx.x; i < G * LG; i += blockDim.x) {
    const int r = i / LG, q = i % LG;
    float m[CL], l[CL];  // past `live`: unset and unused
    float4 v[CL];
#pragma unroll
    for (int k = 0; k < CL; k++) {
      if (k < live) {
        m[k] = __uint_as_float(cl::ld_u32(cl::map(base + L::GML + r * 8, k)));
        l[k] = __uint_as_float(cl::ld_u32(cl::map(base + L::GML + r * 8 + 4, k)));
        v[k] = cl::ld_f4(cl::map(base + L::GO + (r * D + 4 * q) * 4, k));
      }
    }
    float mm = m[0];
#pragma unroll
    for (int k = 1; k < CL; k++)
      if (k < live) mm = fmaxf(mm, m[k]);
    float lsum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < CL; k++) {
      if (k < live) {
        const float f = tc::ex2(m[k] - mm);
        lsum += f * l[k];
        acc[0] += f * v[k].x;
        acc[1] += f * v[k].y;
        acc[2] += f * v[k].z;
        acc[3] += f * v[k].w;
      }
    }
#pragma unroll
    for (int e = 0; e < 4; e++) out[(h * G + r) * D + 4 * q + e] = store<T>(acc[e] / lsum);
  }
}
#endif

template <class T, int D, int CL>
__device__ __forceinline__ void run(const T* __restrict__ qkv, const T* __restrict__ cs,
                                    const T* __restrict__ sn, const int* __restrict__ position,
                                    T* keys, T* values, float* __restrict__ part_o,
                                    float* __restrict__ part_ml, T* __restrict__ out,
                                    unsigned* counters, const DecodeParams& p,
                                    unsigned char* smem) {
  typedef Smem<T, D> L;
  constexpr int HALF = D / 2, KD = D / 16, NO = D / 8, NS = L::NS;
  const int G = (int)(p.q_heads / p.kv_heads);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
  const i64 h = blockIdx.x, s = blockIdx.y;
  const i64 pos = position[0];
  if (pos < 0 || pos >= p.capacity || pos >= p.table_rows) {  // nothing written: NaN out
    if (s == 0)
      for (int i = tid; i < G * D; i += blockDim.x) out[h * G * D + i] = store<T>(0.f / 0.f);
    return;
  }
  // positions lo..pos (lo: 0, or the start of a sliding window), n of them
  const i64 lo = window_start(pos, p.window), n = pos + 1 - lo;
  // ranges merged in a cluster cost a cluster barrier, not a chain of L2 round trips, so
  // there a range may be a single tile (a short cache's work spread over more groups)
  const i64 S = decode_ranges(n, p.splits, CL > 1 ? 1 : NS);
  if (s >= S) {  // no range: in a cluster that merges, still at its two barriers
#if DTC_HAS_CLUSTER
    if constexpr (CL > 1) {
      if (S > 1) {
        cl::sync();
        cl::sync();
      }
    }
#endif
    return;
  }
  const i64 per = (n + S - 1) / S, start = lo + s * per;
  const i64 end = start + per < pos + 1 ? start + per : pos + 1;
  const int tiles = (int)((end - start + TILE - 1) / TILE);
  const u32 base = tc::smem_u32(smem);
  const T* kc = keys + h * p.capacity * D;
  const T* vc = values + h * p.capacity * D;
  auto rows_of = [&](int t) {
    const i64 left = end - start - (i64)t * TILE;
    return (int)(left < TILE ? left : TILE);
  };
  // 1. the first tiles' copies in flight while the queries are roped
#pragma unroll
  for (int t = 0; t < NS - 1; t++) {
    if (t < tiles) stage_tile<T, D>(kc, vc, start + (i64)t * TILE, rows_of(t), base + L::KV + t * L::STAGE);
    tc::cp_commit();
  }
  // 2. rope: the group's query heads into the Q tile (rows past G zero); in the group holding
  // p, the key too, written with the value to the cache and kept for the staged tile
  const bool holds = pos < end;
  T* qs = reinterpret_cast<T*>(smem + L::Q);
  T* new_kv = reinterpret_cast<T*>(smem + L::NEW);
  const T* c_row = cs + pos * HALF;
  const T* s_row = sn + pos * HALF;
  for (int i = tid; i < ROWS * HALF; i += blockDim.x) {
    const int r = i / HALF, d = i % HALF;
    T r1 = store<T>(0.f), r2 = r1;
    if (r < G) {
      const T* x = qkv + (h * G + r) * D;
      const float c = load(c_row[d]), sv = load(s_row[d]);
      const float x1 = load(x[d]), x2 = load(x[d + HALF]);
      r1 = store<T>(x1 * c - x2 * sv);
      r2 = store<T>(x2 * c + x1 * sv);
    }
    qs[tc::swz<D>(r, d / 8) / 2 + d % 8] = r1;
    qs[tc::swz<D>(r, (d + HALF) / 8) / 2 + d % 8] = r2;
  }
  if (holds) {
    for (int d = tid; d < HALF; d += blockDim.x) {
      const T* kx = qkv + (p.q_heads + h) * D;
      const float c = load(c_row[d]), sv = load(s_row[d]);
      const float k1 = load(kx[d]), k2 = load(kx[d + HALF]);
      const T r1 = store<T>(k1 * c - k2 * sv), r2 = store<T>(k2 * c + k1 * sv);
      keys[(h * p.capacity + pos) * D + d] = new_kv[d] = r1;
      keys[(h * p.capacity + pos) * D + d + HALF] = new_kv[d + HALF] = r2;
    }
    for (int d = tid; d < D; d += blockDim.x)
      values[(h * p.capacity + pos) * D + d] = new_kv[D + d] =
          qkv[(p.q_heads + p.kv_heads + h) * D + d];
  }
  __syncthreads();  // the Q tile and the new row seen by the whole group
  u32 qf[KD][4];
#pragma unroll
  for (int kd = 0; kd < KD; kd++)
    tc::ldsm_x4(base + L::Q + tc::swz<D>(lane & 15, kd * 2 + (lane >> 4)), qf[kd]);

  const float sl2 = (p.scale + p.scale_lo) * 1.4426950408889634f;  // base-2 exponent units
  float o[NO][4], m[2], l[2];
#pragma unroll
  for (int j = 0; j < NO; j++)
#pragma unroll
    for (int e = 0; e < 4; e++) o[j][e] = 0.f;
  m[0] = m[1] = neg_inf<float>();
  l[0] = l[1] = 0.f;
  const int k_lo = warp * 16;  // this warp's keys of every tile
  for (int t = 0; t < tiles; t++) {
    // 3. copies of tile t + NS - 1 into the stage tile t - 1 used, then wait for tile t's
    if (t + NS - 1 < tiles)
      stage_tile<T, D>(kc, vc, start + (i64)(t + NS - 1) * TILE, rows_of(t + NS - 1),
                       base + L::KV + ((t + NS - 1) % NS) * L::STAGE);
    tc::cp_commit();
    tc::cp_wait<NS - 1>();
    __syncthreads();
    const i64 t0 = start + (i64)t * TILE;
    const int rows = rows_of(t);
    const u32 ks = base + L::KV + (t % NS) * L::STAGE, vs = ks + TILE * D * 2;
    if (holds && pos < t0 + rows) {  // the same branch for the whole group
      T* kt = reinterpret_cast<T*>(smem + L::KV + (t % NS) * L::STAGE);
      const int r = (int)(pos - t0);
      for (int d = tid; d < D; d += blockDim.x) {
        kt[tc::swz<D>(r, d / 8) / 2 + d % 8] = new_kv[d];
        kt[TILE * D + tc::swz<D>(r, d / 8) / 2 + d % 8] = new_kv[D + d];
      }
      __syncthreads();
    }
    if (k_lo < rows) {  // 4. scores of keys k_lo..k_lo+15 for the 16 rows
      float sc[2][4];
#pragma unroll
      for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) sc[j][e] = 0.f;
#pragma unroll
      for (int kd = 0; kd < KD; kd++) {
        u32 b[4];  // keys k_lo + 0..7 (lanes 0-15) and + 8..15 (lanes 16-31)
        tc::ldsm_x4(ks + tc::swz<D>(k_lo + ((lane >> 4) << 3) + (lane & 7),
                                    kd * 2 + ((lane >> 3) & 1)), b);
        tc::Mma<T>::run(sc[0], qf[kd], b[0], b[1]);
        tc::Mma<T>::run(sc[1], qf[kd], b[2], b[3]);
      }
#pragma unroll
      for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          sc[j][e] = k_lo + j * 8 + t4 * 2 + (e & 1) < rows ? sc[j][e] * sl2 : neg_inf<float>();
      // 5. online softmax of rows g (e 0, 1) and g + 8 (e 2, 3), kept by the row's 4 lanes
#pragma unroll
      for (int r = 0; r < 2; r++) {
        float mx = fmaxf(m[r], fmaxf(fmaxf(sc[0][2 * r], sc[0][2 * r + 1]),
                                     fmaxf(sc[1][2 * r], sc[1][2 * r + 1])));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float alpha = tc::ex2(m[r] - mx);  // m = -inf: 0 (mx is finite: key k_lo is live)
        m[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; j++) {
          sc[j][2 * r] = tc::ex2(sc[j][2 * r] - mx);
          sc[j][2 * r + 1] = tc::ex2(sc[j][2 * r + 1] - mx);
          sum += sc[j][2 * r] + sc[j][2 * r + 1];
        }
        l[r] = l[r] * alpha + sum;  // this lane's columns; the 4 lanes are summed at the end
#pragma unroll
        for (int j = 0; j < NO; j++) {
          o[j][2 * r] *= alpha;
          o[j][2 * r + 1] *= alpha;
        }
      }
      // 6. O += P V over these 16 keys. P (the score registers) goes in as T plus T's
      // remainder, two mma each: rounding P to bf16 alone (as FlashAttention does) put the
      // 8B model's logits 6% from the compiled PyTorch peer's, past the benchmark's bound;
      // the second product costs nothing here (decode is bound by memory, not the mma)
      u32 a[4], r[4];
      tc::split2<T>(sc[0][0], sc[0][1], a[0], r[0]);
      tc::split2<T>(sc[0][2], sc[0][3], a[1], r[1]);
      tc::split2<T>(sc[1][0], sc[1][1], a[2], r[2]);
      tc::split2<T>(sc[1][2], sc[1][3], a[3], r[3]);
#pragma unroll
      for (int np = 0; np < NO / 2; np++) {
        u32 b[4];
        tc::ldsm_x4_t(vs + tc::swz<D>(k_lo + (lane & 15), np * 2 + (lane >> 4)), b);
        tc::Mma<T>::run(o[2 * np], a, b[0], b[1]);
        tc::Mma<T>::run(o[2 * np + 1], a, b[2], b[3]);
        tc::Mma<T>::run(o[2 * np], r, b[0], b[1]);
        tc::Mma<T>::run(o[2 * np + 1], r, b[2], b[3]);
      }
    }
    __syncthreads();  // the stage is free for tile t + NS
  }
  tc::cp_wait<0>();
  __syncthreads();  // (no copy is left in flight into the stages the merge reuses)
  // 7. the 4 warps' states into shared memory: per warp and row (m, l), then o
  float* ml = reinterpret_cast<float*>(smem + L::ML);
  float* os = reinterpret_cast<float*>(smem + L::O);
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float tot = l[r] + __shfl_xor_sync(0xffffffffu, l[r], 1);
    tot += __shfl_xor_sync(0xffffffffu, tot, 2);
    const int row = g + 8 * r;
    if (t4 == 0) {
      ml[(warp * ROWS + row) * 2] = m[r];
      ml[(warp * ROWS + row) * 2 + 1] = tot;
    }
#pragma unroll
    for (int j = 0; j < NO; j++) {
      os[(warp * ROWS + row) * D + j * 8 + t4 * 2] = o[j][2 * r];
      os[(warp * ROWS + row) * D + j * 8 + t4 * 2 + 1] = o[j][2 * r + 1];
    }
  }
  __syncthreads();
  // 8. the group's (m, l, o) per head: thread per (head, dim); one split writes the output
  for (int i = tid; i < G * D; i += blockDim.x) {
    const int r = i / D, d = i % D;
    float mm = neg_inf<float>();
#pragma unroll
    for (int w = 0; w < WARPS; w++) mm = fmaxf(mm, ml[(w * ROWS + r) * 2]);
    float lsum = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) {
      const float f = tc::ex2(ml[(w * ROWS + r) * 2] - mm);  // a warp with no keys: 0
      lsum += f * ml[(w * ROWS + r) * 2 + 1];
      acc += f * os[(w * ROWS + r) * D + d];
    }
    const i64 hq = h * G + r;
    if (S == 1) {
      out[hq * D + d] = store<T>(acc / lsum);
    } else if (CL > 1) {  // for the cluster's first group
      reinterpret_cast<float*>(smem + L::GO)[r * D + d] = acc;
      if (d == 0) {
        reinterpret_cast<float*>(smem + L::GML)[r * 2] = mm;
        reinterpret_cast<float*>(smem + L::GML)[r * 2 + 1] = lsum;
      }
    } else {
      part_o[(hq * p.splits + s) * D + d] = acc;
      if (d == 0) {
        part_ml[(hq * p.splits + s) * 2] = mm;
        part_ml[(hq * p.splits + s) * 2 + 1] = lsum;
      }
    }
  }
  if (S == 1) return;
  // 9. the ranges' states merged. In a cluster (S <= CL: the host's choice) its first group
  // merges its groups' states through distributed shared memory into the output. Otherwise
  // the group that finishes last for this KV head merges the S partials of its heads.
#if DTC_HAS_CLUSTER
  if constexpr (CL > 1) {
    cl::sync();  // every group's state in its shared memory
    if (s == 0) merge_cluster<T, D, CL>(base, (int)S, out, h, G);
    cl::sync();  // no group leaves while the first one reads its shared memory
    return;
  }
#endif
  // Each thread issues its loads (the statistics and 16 partials of o) before it uses any,
  // and works out the weights while they are on their way: one L2 round trip a 16 partials,
  // where a weight pass and then batches of 8 took five at S = 32 (v38).
  if (!arrived_last(counters + h, S)) return;
  merge_partials<T, D>(part_o, part_ml, out, h, G, S, p.splits, lane, warp,
                       reinterpret_cast<float*>(smem + L::W));
  if (tid == 0) counters[h] = 0u;  // ready for the next launch
}
}  // namespace dtc

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // mma.sync, ldmatrix, cp.async
#define DECODE_TC_BODY(T, D, CL)                                                               \
  extern __shared__ __align__(128) unsigned char dtc_smem[];                                   \
  dtc::run<T, D, CL>(qkv, cs, sn, pos, keys, values, part_o, part_ml, out, counters, p,       \
                     dtc_smem);
#else
#define DECODE_TC_BODY(T, D, CL) __trap();
#endif
#define DECODE_TC(SFX, T, D)                                                                   \
  extern "C" __global__ void __launch_bounds__(dtc::WARPS * 32)                                \
      attention_decode_tc##D##_##SFX(DECODE_ATTENTION_PARAMS(T)) {                            \
    pdl_entry();                                                                               \
    DECODE_TC_BODY(T, D, 1)                                                                    \
  }
#if DTC_HAS_CLUSTER
#define DECODE_TC_CLUSTER(SFX, T, D)                                                           \
  extern "C" __global__ void __cluster_dims__(1, dtc::CLUSTER, 1)                              \
      __launch_bounds__(dtc::WARPS * 32) attention_decode_tc##D##c_##SFX(                      \
          DECODE_ATTENTION_PARAMS(T)) {                                                        \
    pdl_entry();                                                                               \
    DECODE_TC_BODY(T, D, dtc::CLUSTER)                                                         \
  }
#else
#define DECODE_TC_CLUSTER(SFX, T, D)
#endif
#define DECODE_TC_ALL(SFX, T)                                                                  \
  DECODE_TC(SFX, T, 64) DECODE_TC(SFX, T, 128)                                                 \
  DECODE_TC_CLUSTER(SFX, T, 64) DECODE_TC_CLUSTER(SFX, T, 128)
ONLY(f16, DECODE_TC_ALL(f16, half_t))
ONLY(bf16, DECODE_TC_ALL(bf16, bf16_t))
