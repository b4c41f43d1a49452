// Shared by every needle CUDA kernel file: storage types, conversions, vector access,
// NaN-aware min/max and warp reductions. No CUDA headers: NVRTC compiles this as is, with
// no toolkit installed (CI), so half and bfloat16 are plain 16-bit storage types here.
#pragma once

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char b8;

struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };
// uint8/int8 storage: structs, so that overloads tell them from bool (b8); they compute in int
struct u8_t { unsigned char v; };
struct i8_t { signed char v; };

struct NParams { i64 n; };

// ---- programmatic dependent launch (sm_90+) ------------------------------------------------
// Every kernel calls pdl_entry() first. Launched with the programmatic-serialization attribute
// (CudaQueue does so inside graph captures on sm_90+), a kernel may be scheduled before the
// previous kernel in the stream has finished; griddepcontrol.wait then blocks until that
// kernel has completed and its writes are visible, so nothing before it touches memory. The
// gain is the launch latency, hidden behind the previous kernel's tail. Kernels do not call
// griddepcontrol.launch_dependents: letting the next kernel's groups in while this one still
// runs made the 1.1B decode step slower (1.34 -> 1.42 ms; waiting only: 1.30 ms). Launched
// without the attribute, or below sm_90, the wait is a no-op.
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- compile shards: one dtype's kernels at a time -----------------------------------------
// Compiled with -DNEEDLE_SHARD -DNEEDLE_SHARD_<sfx> (compiler.py), a kernel file instantiates
// only the kernels whose first dtype suffix is <sfx> (cast_bf16_f32 belongs to bf16,
// take_f32_i64 to f32): NVRTC's time grows with the instantiations, so a model compiles
// only the dtypes it uses, each shard in its own process. Without NEEDLE_SHARD: all of them.
#define NEEDLE_KEEP(...) __VA_ARGS__
#define NEEDLE_DROP(...)
#define ONLY(SFX, ...) ONLY_##SFX(__VA_ARGS__)
#if !defined(NEEDLE_SHARD) || defined(NEEDLE_SHARD_f16)
#define ONLY_f16 NEEDLE_KEEP
#else
#define ONLY_f16 NEEDLE_DROP
#endif
#if !defined(NEEDLE_SHARD) || defined(NEEDLE_SHARD_bf16)
#define ONLY_bf16 NEEDLE_KEEP
#else
#define ONLY_bf16 NEEDLE_DROP
#endif
#if !defined(NEEDLE_SHARD) || defined(NEEDLE_SHARD_f32)
#define ONLY_f32 NEEDLE_KEEP
#else
#define ONLY_f32 NEEDLE_DROP
#endif
#if !defined(NEEDLE_SHARD) || defined(NEEDLE_SHARD_f64)
#define ONLY_f64 NEEDLE_KEEP
#else
#define ONLY_f64 NEEDLE_DROP
#endif
#if !defined(NEEDLE_SHARD) || defined(NEEDLE_SHARD_i32)
#define ONLY_i32 NEEDLE_KEEP
#else
#define ONLY_i32 NEEDLE_DROP
#endif
#if !defined(NEEDLE_SHARD) || defined(NEEDLE_SHARD_i64)
#define ONLY_i64 NEEDLE_KEEP
#else
#define ONLY_i64 NEEDLE_DROP
#endif
#if !defined(NEEDLE_SHARD) || defined(NEEDLE_SHARD_b8)
#define ONLY_b8 NEEDLE_KEEP
#else
#define ONLY_b8 NEEDLE_DROP
#endif
#if !defined(NEEDLE_SHARD) || defined(NEEDLE_SHARD_u8)
#define ONLY_u8 NEEDLE_KEEP
#else
#define ONLY_u8 NEEDLE_DROP
#endif
#if !defined(NEEDLE_SHARD) || defined(NEEDLE_SHARD_i8)
#define ONLY_i8 NEEDLE_KEEP
#else
#define ONLY_i8 NEEDLE_DROP
#endif

template <class S> struct SParams { i64 n; S value; };

// ---- compute types: what a storage type is loaded as, and the scalar param type --------
template <class T> struct Acc { typedef T type; };
template <> struct Acc<half_t> { typedef float type; };
template <> struct Acc<bf16_t> { typedef float type; };
template <> struct Acc<b8> { typedef int type; };
template <> struct Acc<u8_t> { typedef int type; };
template <> struct Acc<i8_t> { typedef int type; };

template <class T> struct Scalar { typedef typename Acc<T>::type type; };

__device__ __forceinline__ float load(half_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
}
__device__ __forceinline__ float load(bf16_t h) { return __uint_as_float(((u32)h.bits) << 16); }
__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ double load(double x) { return x; }
__device__ __forceinline__ int load(int x) { return x; }
__device__ __forceinline__ i64 load(i64 x) { return x; }
__device__ __forceinline__ int load(b8 x) { return x; }
__device__ __forceinline__ int load(u8_t x) { return x.v; }
__device__ __forceinline__ int load(i8_t x) { return x.v; }

// store<T>(compute value): round once to the storage type
template <class T> __device__ __forceinline__ T store(typename Acc<T>::type v) { return v; }
template <> __device__ __forceinline__ half_t store<half_t>(float v) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
  return h;
}
template <> __device__ __forceinline__ bf16_t store<bf16_t>(float v) {
  u32 u = __float_as_uint(v);
  bf16_t h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h.bits = (unsigned short)((u >> 16) | 0x40u);  // quiet NaN, sign kept
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    h.bits = (unsigned short)(u >> 16);
  }
  return h;
}
template <> __device__ __forceinline__ b8 store<b8>(int v) { return (b8)(v != 0); }
// 8-bit integers keep the low 8 bits: arithmetic wraps modulo 2^8 (docs/dtypes.md)
template <> __device__ __forceinline__ u8_t store<u8_t>(int v) {
  u8_t r;
  r.v = (unsigned char)(v & 0xff);
  return r;
}
template <> __device__ __forceinline__ i8_t store<i8_t>(int v) {
  i8_t r;
  r.v = (signed char)(unsigned char)(v & 0xff);
  return r;
}

// ---- math on compute types ---------------------------------------------------------------
template <class C> __device__ __forceinline__ bool is_nan(C x) { return x != x; }

// NaN-propagating max/min (numpy.maximum / numpy.minimum semantics)
template <class C> __device__ __forceinline__ C nan_max(C a, C b) {
  return (a > b || is_nan(a)) ? a : b;
}
template <class C> __device__ __forceinline__ C nan_min(C a, C b) {
  return (a < b || is_nan(a)) ? a : b;
}

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_sin(float x) { return sinf(x); }
__device__ __forceinline__ double m_sin(double x) { return sin(x); }
__device__ __forceinline__ float m_cos(float x) { return cosf(x); }
__device__ __forceinline__ double m_cos(double x) { return cos(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_erf(float x) { return erff(x); }
__device__ __forceinline__ double m_erf(double x) { return erf(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }
__device__ __forceinline__ int m_abs(int x) { return x < 0 ? -x : x; }
__device__ __forceinline__ i64 m_abs(i64 x) { return x < 0 ? -x : x; }

template <class C> __device__ __forceinline__ C neg_inf() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
  return -__longlong_as_double(0x7ff0000000000000ll);
}
template <> __device__ __forceinline__ int neg_inf<int>() { return (int)0x80000000; }
template <> __device__ __forceinline__ i64 neg_inf<i64>() { return (i64)0x8000000000000000ull; }
template <class C> __device__ __forceinline__ C pos_inf() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double pos_inf<double>() {
  return __longlong_as_double(0x7ff0000000000000ll);
}
template <> __device__ __forceinline__ int pos_inf<int>() { return 0x7fffffff; }
template <> __device__ __forceinline__ i64 pos_inf<i64>() { return 0x7fffffffffffffffll; }

// ---- vector access: V elements of T in one 4-, 8- or 16-byte load/store -------------------
template <class T, int V> struct alignas(sizeof(T) * V) Vec { T v[V]; };

__device__ __forceinline__ bool aligned16(const void* p) { return (((u64)p) & 15) == 0; }

// ---- grid-stride geometry ----------------------------------------------------------------
__device__ __forceinline__ i64 global_thread() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * blockDim.x; }

// ---- attention_decode's params (gpu/array.py DECODE): nn.cu's split kernel and decode.cu's
// flash-decoding kernel take the same ones
struct DecodeParams {
  i64 q_heads, kv_heads, head_dim, capacity, table_rows, splits, chunk;
  i64 window;  // a sliding window (positions p - window + 1..p), 0: none
  float scale, scale_lo;  // float64 kernels use scale + scale_lo
  float softcap;          // scores become softcap * tanh(score / softcap) (Gemma 2); 0: none
};

// Gemma 2's soft-capped attention scores, cap * tanh(s / cap), after the scale; cap 0: s
template <class C> __device__ __forceinline__ C soft_cap(C s, float cap) {
  if (cap <= 0.f) return s;
  if constexpr (sizeof(C) == 8) return (C)cap * tanh(s / (C)cap);
  else return cap * tanhf(s / cap);
}

// the first position a decode step at pos attends to: 0, or the start of its sliding window
__device__ __forceinline__ i64 window_start(i64 pos, i64 window) {
  return window > 0 && pos >= window ? pos - window + 1 : 0;
}
// the parameter list of the one-kernel attention_decode forms (decode.cu, decode_tc.cu)
#define DECODE_ATTENTION_PARAMS(T)                                                             \
  const T *__restrict__ qkv, const T *__restrict__ cs, const T *__restrict__ sn,               \
      const int *__restrict__ pos, T *keys, T *values, float *__restrict__ part_o,             \
      float *__restrict__ part_ml, T *__restrict__ out, unsigned *counters, DecodeParams p

// ---- streaming loads: 16 bytes read once (weights), not kept in L1 -----------------------
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
               : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 ld_stream4(const void* p) {
  u32 r;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}
template <class T, int V>
__device__ __forceinline__ Vec<T, V> ld_stream(const Vec<T, V>* p) {
  static_assert(sizeof(Vec<T, V>) == 16, "16-byte vectors");
  const uint4 r = ld_stream16(p);
  return *reinterpret_cast<const Vec<T, V>*>(&r);
}

// ---- warp reductions ----------------------------------------------------------------------
template <class C> __device__ __forceinline__ C warp_sum(C v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class C> __device__ __forceinline__ C warp_max(C v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <class C> __device__ __forceinline__ C sigmoid(C x) {
  return C(0.5) * (m_tanh(C(0.5) * x) + C(1));  // numpy_ref's formula
}

// The output value of a decode-step projection from its float32 sums (decode.cu's dense and
// quant_decode.cu's packed kernels): KIND 0 the product rounded to T; 1 silu(g) * u of the
// gate sum a and up sum b, each rounded first (swiglu of a rounded product); 2 the residual
// `before` plus the rounded product (matvec_add)
template <class T, int KIND>
__device__ __forceinline__ T projection_out(float a, float b, typename Acc<T>::type before) {
  typedef typename Acc<T>::type C;
  if (KIND == 2) return store<T>(before + (C)load(store<T>((C)a)));
  if (KIND == 1) {
    const C g = load(store<T>((C)a)), u = load(store<T>((C)b));
    return store<T>(g * sigmoid(g) * u);
  }
  if (KIND == 3) {  // GeGLU: GELU's tanh form, as nn.cu's geglu computes it
    const C g = load(store<T>((C)a)), u = load(store<T>((C)b));
    const C inner = (g + g * g * g * C(0.044715)) * C(0.7978845608028654);
    return store<T>(g * (tanh(inner) + C(1)) * C(0.5) * u);
  }
  return store<T>((C)a);
}

// 1 / sqrt(mean(x^2) + eps) of x (k values, k a multiple of 16 bytes' worth), summed by one
// warp; every warp sums in the same order, so all get the same factor (the fused gemvs)
template <class T>
__device__ __forceinline__ float warp_rms_factor(const T* x, i64 k, float eps) {
  typedef typename Acc<T>::type C;
  constexpr int V = 16 / sizeof(T);
  const Vec<T, V>* xv = reinterpret_cast<const Vec<T, V>*>(x);
  C ss = C(0);
  for (i64 q = threadIdx.x & 31; q < k / V; q += 32) {
    const Vec<T, V> a = xv[q];
#pragma unroll
    for (int e = 0; e < V; e++) {
      const C t = load(a.v[e]);
      ss += t * t;
    }
  }
  ss = warp_sum(ss);
  return (float)(C(1) / m_sqrt(ss / (C)k + (C)eps));
}

// ---- flash decoding's online softmax over a tile of 64 positions whose scores lane l holds
// for positions l and l + 32 (-inf past the end): the running max m and sum l updated, the
// accumulator rescaled, pr the tile's weights (0 past the end)
template <int PER>
__device__ __forceinline__ void online_softmax_tile(const float (&sc)[2], float& m, float& l,
                                                    float (&acc)[PER], float (&pr)[2]) {
  const float mn = fmaxf(m, warp_max(fmaxf(sc[0], sc[1])));
  const float alpha = m_exp(m - mn);  // 0 on the first tile (m = -inf)
#pragma unroll
  for (int half = 0; half < 2; half++) pr[half] = m_exp(sc[half] - mn);
  l = l * alpha + warp_sum(pr[0] + pr[1]);
  m = mn;
#pragma unroll
  for (int e = 0; e < PER; e++) acc[e] *= alpha;
}

// ---- flash decoding's work on one tile of 64 positions staged in shared memory (decode.cu,
// paged.cu): this warp's scores of the key rows ks (D / V lanes per row, 16-byte reads; rows
// at and past `rows` score -inf) through its 64 floats sc_s, the online softmax, then p·V
// over the value rows vs (lane l owns dims l, l + 32, ...; the rows past `rows` must be
// zeros: probability 0 times garbage could be NaN). qs: the warp's query, float32.
constexpr int FLASH_TILE = 64;
// The dims lane l owns of a head: l, l + 32, ... (e-th: l + 32e); at D = 256 (half types,
// where a lane's 8 dims are 16 bytes) l * 8 .. l * 8 + 7, so that p·V reads a lane's values
// of a row in one 16-byte load instead of eight 2-byte ones.
template <int D> __device__ __forceinline__ int flash_dim(int lane, int e) {
  return D == 256 ? lane * (D / 32) + e : lane + 32 * e;
}
template <class T, int D>
__device__ __forceinline__ void flash_tile(const T* ks, const T* vs, const float* qs,
                                           float* sc_s, int rows, float scale, float softcap,
                                           float& m, float& l, float (&acc)[D / 32]) {
  constexpr int PER = D / 32, V = 16 / sizeof(T), LPR = D / V, RPI = 32 / LPR;
  const int lane = threadIdx.x % 32, kr = lane / LPR, kc = lane % LPR;
#pragma unroll 8
  for (int i = 0; i < FLASH_TILE / RPI; i++) {
    const int jj = i * RPI + kr;
    const Vec<T, V> kv = *reinterpret_cast<const Vec<T, V>*>(ks + jj * D + kc * V);
    float part = 0.f;
#pragma unroll
    for (int e = 0; e < V; e++) part += qs[kc * V + e] * load(kv.v[e]);
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (kc == 0) sc_s[jj] = jj < rows ? soft_cap(part * scale, softcap) : neg_inf<float>();
  }
  __syncwarp();
  const float sc[2] = {sc_s[lane], sc_s[lane + 32]};
  float pr[2];
  online_softmax_tile<PER>(sc, m, l, acc, pr);
#pragma unroll 4
  for (int r = 0; r < FLASH_TILE; r++) {
    const float pj = __shfl_sync(0xffffffffu, r < 32 ? pr[0] : pr[1], r % 32);
    if constexpr (D == 256) {
      static_assert(PER == V, "a lane's dims are one 16-byte vector");
      const Vec<T, V> vv = *reinterpret_cast<const Vec<T, V>*>(vs + r * D + lane * V);
#pragma unroll
      for (int e = 0; e < PER; e++) acc[e] += pj * load(vv.v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < PER; e++) acc[e] += pj * load(vs[r * D + lane + 32 * e]);
    }
  }
}

// ---- flash decoding's ranges for n cached positions: at most `splits`, and at least the
// `stages` tiles of 64 positions a group keeps in flight each, so that a short cache is one
// range (no partials, no merge: at p = 128 on the H100 the 1.1B step took 0.995 ms with one
// range a KV head and 1.026 ms with three) and a long one is cut as before (ceil(tiles /
// stages) >= splits at p = 8000). Every group of the launch computes the same S. A merge
// within a cluster (decode_tc.cu's ...c kernels) is cheap enough to pass stages = 1.
__device__ __forceinline__ i64 decode_ranges(i64 n, i64 splits, int stages) {
  const i64 tiles = (n + 63) / 64, rounds = (tiles + stages - 1) / stages;
  return splits < rounds ? splits : rounds;
}

// ---- whether this group is the last of S to get here (its partials written before the call):
// counted on *counter, which the last group must set back to zero; every thread of the
// group gets the answer, and the last group then sees the others' partials
__device__ __forceinline__ bool arrived_last(unsigned* counter, i64 S) {
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == (unsigned)(S - 1);
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// ---- flash decoding's last step (decode.cu, paged.cu): a group of warps, one per query head,
// leaves its range's float32 partials (acc: lane owns dims lane + 32e; m, l: the softmax
// statistics) at slot base + s, and the group that finishes last of the S ranges (counted
// on *counter, left at zero) merges them (lane l holds partials l and l + 32: S <= 64) and
// writes the head's output o[0..D).
template <class T, int D>
__device__ __forceinline__ void flash_merge(const float (&acc)[D / 32], float m, float l,
                                            float* __restrict__ part_o,
                                            float* __restrict__ part_ml, i64 base, i64 s, i64 S,
                                            unsigned* counter, T* __restrict__ o) {
  constexpr int PER = D / 32;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int e = 0; e < PER; e++) part_o[(base + s) * D + flash_dim<D>(lane, e)] = acc[e];
  if (lane == 0) {
    part_ml[(base + s) * 2] = m;
    part_ml[(base + s) * 2 + 1] = l;
  }
  if (!arrived_last(counter, S)) return;
  float mi[2], li[2], wi[2] = {0.f, 0.f}, total = 0.f;
#pragma unroll
  for (int k = 0; k < 2; k++) {
    const int r = lane + 32 * k;
    mi[k] = r < S ? __ldcg(part_ml + (base + r) * 2) : neg_inf<float>();
    li[k] = r < S ? __ldcg(part_ml + (base + r) * 2 + 1) : 0.f;
  }
  float r_o[PER];
#pragma unroll
  for (int e = 0; e < PER; e++) r_o[e] = 0.f;
  // partials in batches of B (16 at D = 64; 8 at D = 128, whose groups may be 16 warps; 4
  // at D = 256), every
  // load of a batch issued before any is used, and the weights worked out while the first
  // batch is on its way: one L2 round trip a batch (past S the loads give 0, the weights 0)
  constexpr int B = D == 64 ? 16 : D == 128 ? 8 : 4;
  for (int r0 = 0; r0 < S; r0 += B) {
    float v[B][PER];
#pragma unroll
    for (int u = 0; u < B; u++)
#pragma unroll
      for (int e = 0; e < PER; e++)
        v[u][e] = r0 + u < S ? __ldcg(part_o + (base + r0 + u) * D + flash_dim<D>(lane, e))
                             : 0.f;
    if (r0 == 0) {
      const float mm = warp_max(fmaxf(mi[0], mi[1]));
#pragma unroll
      for (int k = 0; k < 2; k++) wi[k] = lane + 32 * k < S ? m_exp(mi[k] - mm) : 0.f;
      total = warp_sum(li[0] * wi[0] + li[1] * wi[1]);
    }
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int r = r0 + u;  // < 64
      const float wr = __shfl_sync(0xffffffffu, r < 32 ? wi[0] : wi[1], r % 32);
#pragma unroll
      for (int e = 0; e < PER; e++) r_o[e] += wr * v[u][e];
    }
  }
#pragma unroll
  for (int e = 0; e < PER; e++) o[flash_dim<D>(lane, e)] = store<T>(r_o[e] / total);
  if (threadIdx.x == 0) *counter = 0u;  // ready for the next launch
}
