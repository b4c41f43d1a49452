// EXPERIMENTAL, not called by the library: scripts/probe_decode_mega.py launches and times it
// (docs/cuda_notes.md v22: correct, and slower than the five-operation layers so far).
//
// decode_layers{D}g{G}_{bf16,f16}: every layer of a Llama-family decode step for one token
// in one persistent launch (numpy_ref: Transformer._fused_layer's five operations with
// folded norms, layer after layer). One group per multiprocessor: 16 consumer warps and 4
// producer warps (one lane issues the bulk copies; all four copy with flag 32).
//
// Why: a 1.1B layer's five launches each pay a ramp, a DRAM round trip and a tail that the
// weight stream does not cover (docs/cuda_notes.md v15-v17). Here weights never wait for
// activations: the producer streams this group's rows of every projection of every layer,
// in the order the consumers use them, through a ring of shared-memory pages (1-D bulk
// copies completing on mbarriers), while the consumers meet at grid-wide barriers between
// stages. A stage's rows arrive during the barrier and the latency-bound attention, so the
// memory system keeps streaming weights through them.
//
// Stages of layer l (each ends with a grid barrier):
//   QKV   qkv[j] = (Wqkv x)[j] * r,  r = 1/sqrt(mean(x^2) + eps)       (gemv_t_norm)
//   ATT   group (KV head h, range s): the query heads of h roped, the key and value written
//         at row p by the range holding it, an online softmax over the range; ranges of at
//         least MIN_RANGE positions; with more than one range a KV head, MERGE (group =
//         query head) combines them after one more barrier
//   O     x[j] += (Wo a)[j]                                            (gemv_t_add)
//   GU    h[j] = silu(g) u, g = (Wgu x)[j] r, u = (Wgu x)[I + j] r       (gemv_glu_norm)
//   DOWN  x[j] += (Wd h)[j]                                            (gemv_t_add)
// Each group owns rows [vb n / NB, (vb + 1) n / NB) of a stage's n (vb: the group's index
// rotated by the stage, so the groups holding one row more differ from stage to stage).
// Roundings are those of the five operations (outputs rounded to T where they round); sums
// run in another order, so results agree to rounding, not bitwise.
// Every group must be resident at once (grid = multiprocessors, one group each): the host
// launches it only so, and never while another kernel could hold a multiprocessor.
#include "common.cuh"
#include "grid_count.cuh"
#include "mbarrier.cuh"
#include "tensor_core.cuh"

namespace dmk {
constexpr int CW = 16;            // consumer warps
constexpr int CT = CW * 32;       // consumer threads
constexpr int PW = 4;             // producer warps
constexpr int PT = PW * 32;       // producer threads
constexpr int THREADS = CT + PT;
constexpr int NP = 5;             // pages in the ring (6 measured no faster)
constexpr u32 PAGE = 28672;       // bytes a page (7 rows of 2,048 bf16; 1 row of 14,336)
constexpr int MIN_RANGE = 256;    // positions a range at least (no merge up to 256)
constexpr int MAX_ROWS = 512;     // accumulators a group (its rows of one stage)

struct Layer {  // one layer's arrays (the probe's table rows)
  const unsigned char* qkv;
  const unsigned char* o;
  const unsigned char* gu;
  const unsigned char* down;
  void* keys;
  void* values;
};

struct Params {  // the probe's PARAMS
  i64 hidden, inter, q_heads, kv_heads, layers, capacity, table_rows, splits;
  float eps, scale;
  // probe knobs: 1 skip the dot products, 2 skip the grid barriers, 4 skip the attention
  // (1, 2 and 4 give wrong results: they time the parts), 8 each page in 4 bulk copies,
  // 16 + (n << 8) L2 prefetches n pages ahead, 32 the producer warps' cp.async instead of
  // bulk copies, 64 no ring: the consumer warps load their rows themselves (direct)
  int flags;
};

// byte offsets into the dynamic shared memory
constexpr u32 FULL = NP * PAGE, EMPTY = FULL + 8 * NP, ACC = EMPTY + 8 * NP;
constexpr u32 MISC = ACC + MAX_ROWS * 4, VEC = MISC + 128;  // VEC: the probe's vec bytes

// the consumer warps only (the producer never joins them)
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(CT) : "memory");
}
// a value another group wrote in this launch: read from L2, never from a stale L1 line
template <class T> __device__ __forceinline__ float ld_fresh(const T* p) {
  T v;
  v.bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
  return load(v);
}

// probe: group 0's %globaltimer at the stage boundaries, stamps[l * 10 + i]
__device__ __forceinline__ void stamp(u64* stamps, i64 i) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && stamps) {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    stamps[i] = t;
  }
}

// every consumer thread of every group waits until all have arrived (grid_count.cuh: sync's
// 8 bytes are the count, `target` this barrier's value of it)
__device__ __forceinline__ void grid_barrier(unsigned* sync, u64& target, int flags) {
  consumers_sync();
  if (flags & 2) return;
  target += gridDim.x;
  if (threadIdx.x == 0) grid_count_wait(sync, target);
  consumers_sync();
}

// this group's rows [r0, r1) of a stage's matrix w (n rows of k values of T)
struct Slice {
  const unsigned char* w;
  i64 k, r0, r1;
};
__device__ __forceinline__ Slice slice_of(const unsigned char* w, i64 n, i64 k, i64 stage) {
  const i64 nb = gridDim.x, vb = (blockIdx.x + stage * 37) % nb;
  return Slice{w, k, vb * n / nb, (vb + 1) * n / nb};
}

// the slices of layer l's projection `which` (0 QKV, 1 O, 2 GU: gate then up, 3 DOWN)
template <int D>
__device__ __forceinline__ int slices(const Layer& L, const Params& p, i64 l, int which,
                                      Slice (&s)[2]) {
  const i64 H = p.hidden, I = p.inter, stage = l * 4 + which;
  switch (which) {
    case 0: s[0] = slice_of(L.qkv, (p.q_heads + 2 * p.kv_heads) * D, H, stage); return 1;
    case 1: s[0] = slice_of(L.o, H, p.q_heads * D, stage); return 1;
    case 2:
      s[0] = slice_of(L.gu, I, H, stage);
      s[1] = s[0];
      s[1].r0 += I;
      s[1].r1 += I;
      return 2;
    default: s[0] = slice_of(L.down, H, I, stage); return 1;
  }
}

template <class T> __device__ __forceinline__ i64 rows_a_page(i64 k) {
  return (i64)PAGE / (k * (i64)sizeof(T));
}

// ---- the producer: every page of every layer, in the consumers' order --------------------
// a position in the schedule of pages: layer l, projection `which`, slice si, first row r
template <class T, int D>
struct Cursor {
  const Layer* layers;
  const Params* p;
  i64 l = 0, r = 0;
  int which = 0, si = 0, ns = 0;
  Slice s[2];
  __device__ Cursor(const Layer* layers_, const Params* p_) : layers(layers_), p(p_) {
    load();
    skip_empty();
  }
  __device__ bool valid() const { return l < p->layers; }
  __device__ void load() {
    if (l < p->layers) {
      ns = slices<D>(layers[l], *p, l, which, s);
      si = 0;
      r = s[0].r0;
    }
  }
  __device__ void skip_empty() {  // past slices with no rows (a group may own none)
    while (valid() && r >= s[si].r1) {
      if (++si < ns) {
        r = s[si].r0;
      } else {
        if (++which == 4) {
          which = 0;
          l++;
        }
        load();
      }
    }
  }
  __device__ void advance() {
    r += rows_a_page<T>(s[si].k);
    skip_empty();
  }
  __device__ const unsigned char* src() const { return s[si].w + r * s[si].k * (i64)sizeof(T); }
  __device__ u32 bytes() const {
    const i64 R = rows_a_page<T>(s[si].k), rows = s[si].r1 - r < R ? s[si].r1 - r : R;
    return (u32)(rows * s[si].k * (i64)sizeof(T));
  }
};

template <class T, int D>
__device__ __forceinline__ void prefetch_l2(const Cursor<T, D>& c) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c.src()), "r"(c.bytes())
               : "memory");
}

template <class T, int D>
__device__ void produce(const Layer* layers, const Params& p, u32 ring) {
  const int pf_pages = (p.flags & 16) ? (p.flags >> 8) : 0;
  const int parts = (p.flags & 8) ? 4 : 1;
  Cursor<T, D> c(layers, &p), pf(layers, &p);
  for (int i = 0; i < pf_pages && pf.valid(); i++, pf.advance()) prefetch_l2(pf);
  for (u32 q = 0; c.valid(); q++, c.advance()) {
    const u32 slot = q % NP, bytes = c.bytes();
    if (q >= NP) bar_wait(ring + EMPTY + 8 * slot, (q / NP - 1) & 1);
    bar_expect_tx(ring + FULL + 8 * slot, bytes);
    if (parts == 1) {
      bulk_copy(ring + slot * PAGE, c.src(), bytes, ring + FULL + 8 * slot);
    } else {
      const u32 part = (bytes / parts + 15) / 16 * 16;
      for (u32 o = 0; o < bytes; o += part)
        bulk_copy(ring + slot * PAGE + o, c.src() + o, bytes - o < part ? bytes - o : part,
                  ring + FULL + 8 * slot);
    }
    if (pf_pages && pf.valid()) {
      prefetch_l2(pf);
      pf.advance();
    }
  }
}

// the same schedule through the producer warps' own 16-byte cp.async copies (each thread a
// share of every page; the page's full barrier counts the PT threads' completions)
template <class T, int D>
__device__ void produce_lsu(const Layer* layers, const Params& p, u32 ring, int t) {
  Cursor<T, D> c(layers, &p);
  for (u32 q = 0; c.valid(); q++, c.advance()) {
    const u32 slot = q % NP, bytes = c.bytes();
    if (q >= NP) bar_wait(ring + EMPTY + 8 * slot, (q / NP - 1) & 1);
    const unsigned char* src = c.src();
    for (u32 o = t * 16; o < bytes; o += PT * 16)
      tc::cp_async16(ring + slot * PAGE + o, src + o, 16);
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n"
                 ::"r"(ring + FULL + 8 * slot) : "memory");
  }
}

// ---- the consumers ------------------------------------------------------------------------
// the dot product of 8 weights and 8 vector values (both T, 16 bytes), in float
template <class T>
__device__ __forceinline__ float dot8(const uint4& w, const uint4& v, float d) {
  const T* a = reinterpret_cast<const T*>(&w);
  const T* b = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; i++) d = fmaf(load(a[i]), load(b[i]), d);
  return d;
}

// A warp's contiguous run of granules (256 values of a row: the warp's 32 16-byte chunks),
// starting at granule g0 of rows of upr granules: each lane sums its chunk's products until
// the run leaves a row, then one warp sum and one shared atomic into that row's acc
template <class T>
struct RowRun {
  float* acc;  // the accumulator of row 0
  int upr, row, col;
  float d = 0.f;
  __device__ RowRun(float* acc_, int upr_, int g0)
      : acc(acc_), upr(upr_), row(g0 / upr_), col(g0 % upr_) {}
  // the next granule's weights w (this lane's chunk); `last`: the run ends with it
  __device__ __forceinline__ void take(const uint4& w, const uint4* vec, bool dot, bool last) {
    if (dot) d = dot8<T>(w, vec[col * 32 + (threadIdx.x & 31)], d);
    if (++col == upr || last) {
      d = warp_sum(d);
      if ((threadIdx.x & 31) == 0) atomicAdd(acc + row, d);
      d = 0.f;
      col = 0;
      row++;
    }
  }
};

// acc[off + row - r0] += (row of the slice) . vec, page by page as the producer fills them;
// warp w takes a contiguous run of each page's granules (RowRun).
template <class T>
__device__ __forceinline__ void consume(const Slice& s, int off, u32& q, u32 ring,
                                        const unsigned char* smem, const uint4* vec,
                                        float* acc, int flags) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int R = (int)rows_a_page<T>(s.k), upr = (int)(s.k * (i64)sizeof(T) / 512);
  for (i64 r = s.r0; r < s.r1; r += R, q++) {
    const int rows = s.r1 - r < R ? (int)(s.r1 - r) : R, total = rows * upr;
    const int per = (total + CW - 1) / CW, g0 = warp * per;
    const int g1 = g0 + per < total ? g0 + per : total;
    const u32 slot = q % NP;
    bar_wait(ring + FULL + 8 * slot, (q / NP) & 1);
    const uint4* page = reinterpret_cast<const uint4*>(smem + slot * PAGE);
    if (g0 < g1 && !(flags & 1)) {
      RowRun<T> run(acc + off + (r - s.r0), upr, g0);
      for (int g = g0; g < g1; g++) run.take(page[g * 32 + lane], vec, true, g + 1 == g1);
    }
    // every lane releases its own reads of the page (one lane after __syncwarp ran as fast,
    // but racecheck reported the next copy into the page as a hazard: cuda_notes v22)
    bar_arrive(ring + EMPTY + 8 * slot);
  }
}

// consume without the ring (flag 64): each warp loads a contiguous run of the slice's
// granules itself, U 16-byte loads a lane in flight, as gemv_t does
template <class T>
__device__ __forceinline__ void consume_direct(const Slice& s, int off, const uint4* vec,
                                               float* acc, int flags) {
  constexpr int U = 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int upr = (int)(s.k * (i64)sizeof(T) / 512), total = (int)(s.r1 - s.r0) * upr;
  const int per = (total + CW - 1) / CW, g0 = warp * per;
  const int g1 = g0 + per < total ? g0 + per : total;
  if (g0 >= g1) return;
  const uint4* base = reinterpret_cast<const uint4*>(s.w + s.r0 * s.k * (i64)sizeof(T)) + lane;
  RowRun<T> run(acc + off, upr, g0);
  for (int g = g0; g < g1; g += U) {
    uint4 w[U];
#pragma unroll
    for (int u = 0; u < U; u++)
      if (g + u < g1) w[u] = ld_stream16(base + (i64)(g + u) * 32);
#pragma unroll
    for (int u = 0; u < U; u++)
      if (g + u < g1) run.take(w[u], vec, !(flags & 1), g + u + 1 == g1);
  }
}

// this stage's rows of slice s: from the ring, or directly (flag 64)
template <class T>
__device__ __forceinline__ void rows_dot(const Slice& s, int off, u32& q, u32 ring,
                                         const unsigned char* smem, const uint4* vec,
                                         float* acc, int flags) {
  if (flags & 64)
    consume_direct<T>(s, off, vec, acc, flags);
  else
    consume<T>(s, off, q, ring, smem, vec, acc, flags);
}

// vec[0..n) = src (T, as stored: every stage input is a T array); returns
// 1/sqrt(mean(src^2) + eps) when `norm` (else 1)
template <class T>
__device__ __forceinline__ float stage_vec(const T* src, i64 n, bool norm, float eps,
                                           uint4* vec, float* misc) {
  float ss = 0.f;
  const uint4* sv = reinterpret_cast<const uint4*>(src);
  for (i64 i = threadIdx.x; i < n * (i64)sizeof(T) / 16; i += CT) {
    const uint4 v = __ldcg(sv + i);  // another group wrote it in this launch: from L2
    vec[i] = v;
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int j = 0; j < 16 / (int)sizeof(T); j++) ss = fmaf(load(e[j]), load(e[j]), ss);
  }
  if (!norm) {
    consumers_sync();
    return 1.f;
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) misc[threadIdx.x >> 5] = ss;
  consumers_sync();
  float tot = 0.f;
#pragma unroll
  for (int w = 0; w < CW; w++) tot += misc[w];
  return 1.f / sqrtf(tot / (float)n + eps);
}

// x[j] += the product's row j (rounded to T first, as gemv_t_add) for this group's rows,
// the accumulators zeroed for the next stage
template <class T>
__device__ __forceinline__ void add_rows(T* x, const Slice& s, float* acc) {
  for (i64 i = threadIdx.x; i < s.r1 - s.r0; i += CT) {
    T* xi = x + s.r0 + i;
    *xi = store<T>(ld_fresh(xi) + load(store<T>(acc[i])));
    acc[i] = 0.f;
  }
}

// ---- attention of the token at `pos` for group `unit` = (KV head h, range s) ---------------
template <class T, int D, int G>
__device__ void attend(const T* qkv, const T* cs, const T* sn, T* keys, T* values, T* attn,
                       float* part_o, float* part_ml, i64 pos, i64 unit, i64 S, i64 per,
                       const Params& p, float* vec) {
  constexpr int HALF = D / 2, LPH = 32 / G, DPL = D / LPH;
  static_assert(DPL == 16, "a lane holds 16 values of its head's query and output");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const i64 h = unit / S, s = unit % S, n = pos + 1, start = s * per;
  const i64 end = start + per < n ? start + per : n;
  float* qs = vec;                // [G][D] roped queries
  float* wml = vec + G * D;       // [CW][G][2] each warp's (m, l)
  float* wo = wml + CW * G * 2;   // [CW][G][D] each warp's output
  const T* c_row = cs + pos * HALF;
  const T* s_row = sn + pos * HALF;
  for (int i = tid; i < G * HALF; i += CT) {  // queries roped and rounded, as rope stores them
    const int r = i / HALF, d = i % HALF;
    const T* x = qkv + (h * G + r) * D;
    const float c = load(c_row[d]), sv = load(s_row[d]);
    const float x1 = ld_fresh(x + d), x2 = ld_fresh(x + d + HALF);
    qs[r * D + d] = load(store<T>(x1 * c - x2 * sv));
    qs[r * D + d + HALF] = load(store<T>(x2 * c + x1 * sv));
  }
  T* krow = keys + (h * p.capacity + pos) * D;
  T* vrow = values + (h * p.capacity + pos) * D;
  if (end == n) {  // this range holds p: the new key (roped) and value into the cache
    const T* kx = qkv + (p.q_heads + h) * D;
    const T* vx = qkv + (p.q_heads + p.kv_heads + h) * D;
    for (int d = tid; d < HALF; d += CT) {
      const float c = load(c_row[d]), sv = load(s_row[d]);
      const float k1 = ld_fresh(kx + d), k2 = ld_fresh(kx + d + HALF);
      krow[d] = store<T>(k1 * c - k2 * sv);
      krow[d + HALF] = store<T>(k2 * c + k1 * sv);
    }
    for (int d = tid; d < D; d += CT) vrow[d] = store<T>(ld_fresh(vx + d));
  }
  consumers_sync();  // queries in shared memory, the new row in the cache (this group's)
  const int hq = lane / LPH, d0 = (lane % LPH) * DPL;
  const float sl2 = p.scale * 1.4426950408889634f;  // scores in base-2 exponent units
  float qr[DPL], o[DPL], m = neg_inf<float>(), l = 0.f;
#pragma unroll
  for (int i = 0; i < DPL; i++) {
    qr[i] = qs[hq * D + d0 + i] * sl2;
    o[i] = 0.f;
  }
  const T* kbase = keys + h * p.capacity * D + d0;
  const T* vbase = values + h * p.capacity * D + d0;
#pragma unroll 4
  for (i64 t = start + warp; t < end; t += CW) {
    const uint4* kp = reinterpret_cast<const uint4*>(kbase + t * D);
    const uint4* vp = reinterpret_cast<const uint4*>(vbase + t * D);
    const uint4 k0 = kp[0], k1 = kp[1], v0 = vp[0], v1 = vp[1];
    float sc = 0.f;
    {
      const T* ka = reinterpret_cast<const T*>(&k0);
      const T* kb = reinterpret_cast<const T*>(&k1);
#pragma unroll
      for (int i = 0; i < 8; i++) sc = fmaf(qr[i], load(ka[i]), sc);
#pragma unroll
      for (int i = 0; i < 8; i++) sc = fmaf(qr[8 + i], load(kb[i]), sc);
    }
#pragma unroll
    for (int x = 1; x < LPH; x <<= 1) sc += __shfl_xor_sync(0xffffffffu, sc, x);
    const float mn = fmaxf(m, sc), alpha = tc::ex2(m - mn), pr = tc::ex2(sc - mn);
    l = l * alpha + pr;
    m = mn;
    const T* va = reinterpret_cast<const T*>(&v0);
    const T* vb = reinterpret_cast<const T*>(&v1);
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = fmaf(pr, load(va[i]), o[i] * alpha);
#pragma unroll
    for (int i = 0; i < 8; i++) o[8 + i] = fmaf(pr, load(vb[i]), o[8 + i] * alpha);
  }
  if (lane % LPH == 0) {
    wml[(warp * G + hq) * 2] = m;
    wml[(warp * G + hq) * 2 + 1] = l;
  }
#pragma unroll
  for (int i = 0; i < DPL; i++) wo[(warp * G + hq) * D + d0 + i] = o[i];
  consumers_sync();
  for (int i = tid; i < G * D; i += CT) {  // the 16 warps' states of head r, dim d
    const int r = i / D, d = i % D;
    float mm = neg_inf<float>();
#pragma unroll
    for (int w = 0; w < CW; w++) mm = fmaxf(mm, wml[(w * G + r) * 2]);
    float lsum = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < CW; w++) {
      const float f = tc::ex2(wml[(w * G + r) * 2] - mm);  // a warp without positions: 0
      lsum = fmaf(f, wml[(w * G + r) * 2 + 1], lsum);
      acc = fmaf(f, wo[(w * G + r) * D + d], acc);
    }
    const i64 head = h * G + r;
    if (S == 1) {
      attn[head * D + d] = store<T>(acc / lsum);
    } else {
      part_o[(head * p.splits + s) * D + d] = acc;
      if (d == 0) {
        part_ml[(head * p.splits + s) * 2] = mm;
        part_ml[(head * p.splits + s) * 2 + 1] = lsum;
      }
    }
  }
}

// the S ranges' partials of query head `head` into its output
template <class T, int D>
__device__ void merge(const float* part_o, const float* part_ml, T* attn, i64 head, i64 S,
                      const Params& p) {
  for (int d = threadIdx.x; d < D; d += CT) {
    float mm = neg_inf<float>();
    for (i64 i = 0; i < S; i++) mm = fmaxf(mm, __ldcg(part_ml + (head * p.splits + i) * 2));
    float lsum = 0.f, acc = 0.f;
    for (i64 i = 0; i < S; i++) {
      const float f = tc::ex2(__ldcg(part_ml + (head * p.splits + i) * 2) - mm);
      lsum = fmaf(f, __ldcg(part_ml + (head * p.splits + i) * 2 + 1), lsum);
      acc = fmaf(f, __ldcg(part_o + (head * p.splits + i) * D + d), acc);
    }
    attn[head * D + d] = store<T>(acc / lsum);
  }
}

template <class T, int D, int G>
__device__ void run(const Layer* layers, T* x, T* qkv, T* attn, T* hbuf, float* part_o,
                    float* part_ml, const T* cs, const T* sn, const int* position,
                    unsigned* sync, u64* stamps, const Params& p, unsigned char* smem) {
  const u32 ring = tc::smem_u32(smem);
  const int tid = threadIdx.x;
  float* acc = reinterpret_cast<float*>(smem + ACC);
  float* misc = reinterpret_cast<float*>(smem + MISC);
  float* vec = reinterpret_cast<float*>(smem + VEC);
  uint4* vecv = reinterpret_cast<uint4*>(smem + VEC);
  const int flags = p.flags;
  if (tid == 0) {
    for (int i = 0; i < NP; i++) {
      bar_init(ring + FULL + 8 * i, (flags & 32) ? PT : 1);
      bar_init(ring + EMPTY + 8 * i, CT);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int i = tid; i < MAX_ROWS; i += THREADS) acc[i] = 0.f;
  __syncthreads();
  const i64 pos = position[0];
  if (pos < 0 || pos >= p.capacity || pos >= p.table_rows) {  // nothing written: NaN out
    if (blockIdx.x == 0)
      for (i64 i = tid; i < p.hidden; i += THREADS) x[i] = store<T>(0.f / 0.f);
    return;
  }
  if (tid >= CT) {  // the producer warps
    if (flags & 64)
      return;
    if (flags & 32)
      produce_lsu<T, D>(layers, p, ring, tid - CT);
    else if (tid == CT)
      produce<T, D>(layers, p, ring);
    return;
  }
  u64 target = tid == 0 ? grid_count_base(sync) : 0;  // the barriers' count (thread 0)
  u32 q = 0;
  const i64 H = p.hidden, I = p.inter, n = pos + 1;
  i64 per = (n + p.splits - 1) / p.splits;
  per = per < MIN_RANGE ? MIN_RANGE : per;
  const i64 S = (n + per - 1) / per;
  for (i64 l = 0; l < p.layers; l++) {
    const Layer L = layers[l];
    Slice s[2];
    stamp(stamps, l * 10 + 0);
    // QKV
    float r = stage_vec(x, H, true, p.eps, vecv, misc);
    slices<D>(L, p, l, 0, s);
    rows_dot<T>(s[0], 0, q, ring, smem, vecv, acc, flags);
    stamp(stamps, l * 10 + 1);
    consumers_sync();
    for (i64 i = tid; i < s[0].r1 - s[0].r0; i += CT) {
      qkv[s[0].r0 + i] = store<T>(acc[i] * r);
      acc[i] = 0.f;
    }
    grid_barrier(sync, target, flags);
    stamp(stamps, l * 10 + 2);
    // ATT (and MERGE)
    T* keys = static_cast<T*>(L.keys);
    T* values = static_cast<T*>(L.values);
    for (i64 u = blockIdx.x; u < p.kv_heads * S && !(flags & 4); u += gridDim.x) {
      attend<T, D, G>(qkv, cs, sn, keys, values, attn, part_o, part_ml, pos, u, S, per, p, vec);
      consumers_sync();
    }
    grid_barrier(sync, target, flags);
    if (S > 1) {
      for (i64 head = blockIdx.x; head < p.q_heads; head += gridDim.x)
        merge<T, D>(part_o, part_ml, attn, head, S, p);
      grid_barrier(sync, target, flags);
    }
    stamp(stamps, l * 10 + 3);
    // O
    stage_vec(attn, p.q_heads * D, false, p.eps, vecv, misc);
    slices<D>(L, p, l, 1, s);
    rows_dot<T>(s[0], 0, q, ring, smem, vecv, acc, flags);
    stamp(stamps, l * 10 + 4);
    consumers_sync();
    add_rows(x, s[0], acc);
    grid_barrier(sync, target, flags);
    stamp(stamps, l * 10 + 5);
    // GU
    r = stage_vec(x, H, true, p.eps, vecv, misc);
    slices<D>(L, p, l, 2, s);
    const int nr = (int)(s[0].r1 - s[0].r0);
    rows_dot<T>(s[0], 0, q, ring, smem, vecv, acc, flags);
    rows_dot<T>(s[1], nr, q, ring, smem, vecv, acc, flags);
    stamp(stamps, l * 10 + 6);
    consumers_sync();
    for (int i = tid; i < nr; i += CT) {
      const float g = load(store<T>(acc[i] * r)), u = load(store<T>(acc[nr + i] * r));
      hbuf[s[0].r0 + i] = store<T>(g * sigmoid(g) * u);
      acc[i] = acc[nr + i] = 0.f;
    }
    grid_barrier(sync, target, flags);
    stamp(stamps, l * 10 + 7);
    // DOWN
    stage_vec(hbuf, I, false, p.eps, vecv, misc);
    slices<D>(L, p, l, 3, s);
    rows_dot<T>(s[0], 0, q, ring, smem, vecv, acc, flags);
    stamp(stamps, l * 10 + 8);
    consumers_sync();
    add_rows(x, s[0], acc);
    if (l + 1 < p.layers) grid_barrier(sync, target, flags);
    stamp(stamps, l * 10 + 9);
  }
}
}  // namespace dmk

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // bulk copies, mbarrier transactions
#define DECODE_MEGA_BODY(T, D, G)                                                              \
  extern __shared__ __align__(128) unsigned char dmk_smem[];                                   \
  dmk::run<T, D, G>(layers, x, qkv, attn, hbuf, part_o, part_ml, cs, sn, position, sync,      \
                    stamps, p, dmk_smem);
#else
#define DECODE_MEGA_BODY(T, D, G) __trap();
#endif
#define DECODE_MEGA(SFX, T, D, G)                                                              \
  extern "C" __global__ void __launch_bounds__(dmk::THREADS, 1) decode_layers##D##g##G##_##SFX( \
      const dmk::Layer* __restrict__ layers, T* x, T* qkv, T* attn, T* hbuf, float* part_o,    \
      float* part_ml, const T* __restrict__ cs, const T* __restrict__ sn,                      \
      const int* __restrict__ position, unsigned* sync, u64* stamps, dmk::Params p) {        \
    pdl_entry();                                                                               \
    DECODE_MEGA_BODY(T, D, G)                                                                  \
  }
#define DECODE_MEGA_ALL(SFX, T) DECODE_MEGA(SFX, T, 64, 8) DECODE_MEGA(SFX, T, 128, 4)
ONLY(f16, DECODE_MEGA_ALL(f16, half_t))
ONLY(bf16, DECODE_MEGA_ALL(bf16, bf16_t))
