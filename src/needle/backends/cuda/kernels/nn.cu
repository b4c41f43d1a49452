// Transformer kernels (docs/kernels.md, "nn"): row kernels (softmax, log_softmax, rmsnorm,
// layernorm), rope, and attention (flash-style tiles; split-K partials for decoding; a
// tensor-core kernel for half precisions with head_dim 64 or 128).
#include "common.cuh"
#include "attention.cuh"
#include "tensor_core.cuh"

struct RowParams { i64 rows, dim; };
template <class S> struct NormParams { i64 rows, dim; S eps; };
struct RopeParams { i64 batch, seq, heads, head_dim; };

// ---- row kernels: threads (TX, TY); TX threads (whole warps) per row, TY rows per group --
// Reduce v over the TX threads of this thread's row. Every thread of the group calls it
// (rows past the end included), since it may synchronize the group.
template <class C, class F>
__device__ __forceinline__ C row_reduce(C v, F f, C* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int nw = blockDim.x / 32;
  if (nw > 1) {
    C* mine = smem + threadIdx.y * nw;
    __syncthreads();
    if (threadIdx.x % 32 == 0) mine[threadIdx.x / 32] = v;
    __syncthreads();
    v = mine[0];
    for (int w = 1; w < nw; w++) v = f(v, mine[w]);
  }
  return v;
}

struct SumF { template <class C> __device__ C operator()(C a, C b) const { return a + b; } };
struct MaxF { template <class C> __device__ C operator()(C a, C b) const { return nan_max(a, b); } };

// A row held in registers: thread t keeps elements t, t + TX, ... (or 16-byte vectors
// t, t + TX, ... when the row allows), so a row kernel reads its input once. Used when
// dim <= CACHE * TX; longer rows take the streaming path (two reads, the second from L2).
constexpr int CACHE = 16;
template <class T> struct RowCache {
  typedef typename Acc<T>::type C;
  static constexpr int V = 16 / sizeof(T) < CACHE ? 16 / sizeof(T) : CACHE;
  C v[CACHE];
  bool vec;

  __device__ static bool fits(i64 dim) { return dim <= (i64)CACHE * blockDim.x; }

  // slot s of this thread holds element index(s), or nothing when index(s) >= dim
  __device__ __forceinline__ i64 index(int s) const {
    return vec ? (threadIdx.x + (i64)(s / V) * blockDim.x) * V + s % V
               : threadIdx.x + (i64)s * blockDim.x;
  }

  __device__ __forceinline__ void read(const T* __restrict__ x, i64 dim, C fill) {
    vec = aligned16(x) && dim % V == 0;
    if (vec) {
#pragma unroll
      for (int k = 0; k < CACHE / V; k++) {
        const i64 jv = threadIdx.x + (i64)k * blockDim.x;
        if (jv * V < dim) {
          const Vec<T, V> w = reinterpret_cast<const Vec<T, V>*>(x)[jv];
#pragma unroll
          for (int e = 0; e < V; e++) v[k * V + e] = (C)load(w.v[e]);
        } else {
#pragma unroll
          for (int e = 0; e < V; e++) v[k * V + e] = fill;
        }
      }
    } else {
#pragma unroll
      for (int s = 0; s < CACHE; s++) {
        const i64 j = index(s);
        v[s] = j < dim ? (C)load(x[j]) : fill;
      }
    }
  }

  // y[j] = f(cached value, j) for every element of the row
  template <class F>
  __device__ __forceinline__ void write(T* __restrict__ y, i64 dim, F f) const {
    if (vec) {
#pragma unroll
      for (int k = 0; k < CACHE / V; k++) {
        const i64 jv = threadIdx.x + (i64)k * blockDim.x;
        if (jv * V < dim) {
          Vec<T, V> w;
#pragma unroll
          for (int e = 0; e < V; e++) w.v[e] = store<T>(f(v[k * V + e], jv * V + e));
          reinterpret_cast<Vec<T, V>*>(y)[jv] = w;
        }
      }
    } else {
#pragma unroll
      for (int s = 0; s < CACHE; s++) {
        const i64 j = index(s);
        if (j < dim) y[j] = store<T>(f(v[s], j));
      }
    }
  }
};

// softmax statistics (running max m, sum s of exp(x - m)), merged across threads
template <class C> struct MaxSum { C m, s; };
template <class C> __device__ __forceinline__ MaxSum<C> merge(MaxSum<C> a, MaxSum<C> b) {
  const C m = a.m > b.m ? a.m : b.m;
  const C sa = a.s == C(0) ? C(0) : a.s * m_exp(a.m - m);
  const C sb = b.s == C(0) ? C(0) : b.s * m_exp(b.m - m);
  return {m, sa + sb};
}
template <class C> __device__ __forceinline__ void push(MaxSum<C>& st, C x) {
  if (x > st.m) {
    st.s = st.s * m_exp(st.m - x) + C(1);
    st.m = x;
  } else if (!(x == st.m && x == neg_inf<C>())) {
    st.s += m_exp(x - st.m);  // NaN x makes s NaN, as the reference's NaN max does
  }
}

// softmax of a row held in registers: max, then sum of exp(x - max), then write
template <class T, bool LOG>
__device__ __forceinline__ void softmax_cached(const T* __restrict__ x, T* __restrict__ y,
                                               bool live, i64 dim, unsigned char* smem) {
  typedef typename Acc<T>::type C;
  RowCache<T> r;
  if (live) r.read(x, dim, neg_inf<C>());
  else { r.vec = false; for (int s = 0; s < CACHE; s++) r.v[s] = neg_inf<C>(); }
  C m = neg_inf<C>();
#pragma unroll
  for (int s = 0; s < CACHE; s++) m = nan_max(m, r.v[s]);
  m = row_reduce(m, MaxF(), reinterpret_cast<C*>(smem));
  C sum = C(0);
#pragma unroll
  for (int s = 0; s < CACHE; s++) sum += r.v[s] == neg_inf<C>() ? C(0) : m_exp(r.v[s] - m);
  sum = row_reduce(sum, SumF(), reinterpret_cast<C*>(smem));
  if (!live) return;
  // a +inf in the row makes every output NaN, as x - max does in the reference
  if (m == pos_inf<C>()) sum = C(0) / C(0);
  if (LOG) {
    const C logs = m_log(sum);
    r.write(y, dim, [&](C v, i64) { return (v - m) - logs; });
  } else {
    const C inv = C(1) / sum;
    r.write(y, dim, [&](C v, i64) { return m_exp(v - m) * inv; });
  }
}

template <class T, bool LOG>
__device__ __forceinline__ void softmax_rows(const T* __restrict__ a, T* __restrict__ out,
                                             const RowParams& p, unsigned char* smem_raw) {
  typedef typename Acc<T>::type C;
  const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < p.rows;
  const T* x = a + (live ? row : 0) * p.dim;
  if (RowCache<T>::fits(p.dim)) {
    softmax_cached<T, LOG>(x, out + (live ? row : 0) * p.dim, live, p.dim, smem_raw);
    return;
  }
  MaxSum<C> st = {neg_inf<C>(), C(0)};
  if (live)
    for (i64 j = threadIdx.x; j < p.dim; j += blockDim.x) push(st, (C)load(x[j]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum<C> other = {__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o)};
    st = merge(st, other);
  }
  const int nw = blockDim.x / 32;
  if (nw > 1) {
    MaxSum<C>* mine = reinterpret_cast<MaxSum<C>*>(smem_raw) + threadIdx.y * nw;
    __syncthreads();
    if (threadIdx.x % 32 == 0) mine[threadIdx.x / 32] = st;
    __syncthreads();
    st = mine[0];
    for (int w = 1; w < nw; w++) st = merge(st, mine[w]);
  }
  if (!live) return;
  // a +inf in the row makes every output NaN, as x - max does in the reference
  const C s = st.m == pos_inf<C>() ? C(0) / C(0) : st.s;
  T* y = out + row * p.dim;
  if (LOG) {
    const C logs = m_log(s);  // (x - m) - log(s): m + log(s) would round log(s) away
    for (i64 j = threadIdx.x; j < p.dim; j += blockDim.x) y[j] = store<T>(((C)load(x[j]) - st.m) - logs);
  } else {
    const C inv = C(1) / s;
    for (i64 j = threadIdx.x; j < p.dim; j += blockDim.x) y[j] = store<T>(m_exp((C)load(x[j]) - st.m) * inv);
  }
}

template <class T>
__device__ __forceinline__ void rmsnorm_rows(const T* __restrict__ a, const T* __restrict__ w,
                                             T* __restrict__ out, i64 rows, i64 dim,
                                             typename Acc<T>::type eps, unsigned char* smem) {
  typedef typename Acc<T>::type C;
  const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const T* x = a + (live ? row : 0) * dim;
  if (RowCache<T>::fits(dim)) {
    RowCache<T> r;
    if (live) r.read(x, dim, C(0));
    else { r.vec = false; for (int s = 0; s < CACHE; s++) r.v[s] = C(0); }
    C ss = C(0);
#pragma unroll
    for (int s = 0; s < CACHE; s++) ss += r.v[s] * r.v[s];
    ss = row_reduce(ss, SumF(), reinterpret_cast<C*>(smem));
    if (!live) return;
    const C rs = C(1) / m_sqrt(ss / (C)dim + eps);
    r.write(out + row * dim, dim, [&](C v, i64 j) { return v * rs * (C)load(w[j]); });
    return;
  }
  C ss = C(0);
  if (live)
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
      const C v = load(x[j]);
      ss += v * v;
    }
  ss = row_reduce(ss, SumF(), reinterpret_cast<C*>(smem));
  if (!live) return;
  const C r = C(1) / m_sqrt(ss / (C)dim + eps);
  T* y = out + row * dim;
  for (i64 j = threadIdx.x; j < dim; j += blockDim.x) y[j] = store<T>((C)load(x[j]) * r * (C)load(w[j]));
}

template <class T>
__device__ __forceinline__ void layernorm_rows(const T* __restrict__ a, const T* __restrict__ w,
                                               const T* __restrict__ b, T* __restrict__ out,
                                               i64 rows, i64 dim, typename Acc<T>::type eps,
                                               unsigned char* smem) {
  typedef typename Acc<T>::type C;
  const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const T* x = a + (live ? row : 0) * dim;
  if (RowCache<T>::fits(dim)) {
    RowCache<T> r;
    if (live) r.read(x, dim, C(0));
    else { r.vec = false; for (int s = 0; s < CACHE; s++) r.v[s] = C(0); }
    C sum = C(0);
#pragma unroll
    for (int s = 0; s < CACHE; s++) sum += r.v[s];
    const C mean = row_reduce(sum, SumF(), reinterpret_cast<C*>(smem)) / (C)dim;
    C sq = C(0);
#pragma unroll
    for (int s = 0; s < CACHE; s++) {
      const C d = r.index(s) < dim ? r.v[s] - mean : C(0);
      sq += d * d;
    }
    const C var = row_reduce(sq, SumF(), reinterpret_cast<C*>(smem)) / (C)dim;
    if (!live) return;
    const C denom = m_sqrt(var + eps);
    r.write(out + row * dim, dim, [&](C v, i64 j) {
      return (v - mean) / denom * (C)load(w[j]) + (C)load(b[j]);
    });
    return;
  }
  C sum = C(0);
  if (live)
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) sum += (C)load(x[j]);
  const C mean = row_reduce(sum, SumF(), reinterpret_cast<C*>(smem)) / (C)dim;
  C sq = C(0);
  if (live)
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
      const C d = (C)load(x[j]) - mean;
      sq += d * d;
    }
  const C var = row_reduce(sq, SumF(), reinterpret_cast<C*>(smem)) / (C)dim;
  if (!live) return;
  const C denom = m_sqrt(var + eps);
  T* y = out + row * dim;
  for (i64 j = threadIdx.x; j < dim; j += blockDim.x)
    y[j] = store<T>(((C)load(x[j]) - mean) / denom * (C)load(w[j]) + (C)load(b[j]));
}

// ---- add_rmsnorm: total = x + delta (rounded), out = rmsnorm(total) * w --------------------
// x and total may be one array (no __restrict__ on them): each thread reads its elements of
// x before it writes the same elements of total.
template <class T>
__device__ __forceinline__ void add_rmsnorm_rows(const T* x_all, const T* __restrict__ d_all,
                                                 const T* __restrict__ w, T* total_all,
                                                 T* __restrict__ out, i64 rows, i64 dim,
                                                 typename Acc<T>::type eps, unsigned char* smem) {
  typedef typename Acc<T>::type C;
  const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const i64 base = (live ? row : 0) * dim;
  if (RowCache<T>::fits(dim)) {
    RowCache<T> r, e;
    if (live) {
      r.read(x_all + base, dim, C(0));
      e.read(d_all + base, dim, C(0));
      e.vec = e.vec && r.vec;  // one slot layout for both (both aligned or neither)
      if (r.vec != e.vec) {
        r.vec = e.vec = false;
        for (int s = 0; s < CACHE; s++) {
          const i64 j = r.index(s);
          r.v[s] = j < dim ? (C)load(x_all[base + j]) : C(0);
          e.v[s] = j < dim ? (C)load(d_all[base + j]) : C(0);
        }
      }
    } else {
      r.vec = false;
      for (int s = 0; s < CACHE; s++) r.v[s] = e.v[s] = C(0);
    }
    C ss = C(0);
#pragma unroll
    for (int s = 0; s < CACHE; s++) {
      r.v[s] = (C)load(store<T>(r.v[s] + e.v[s]));  // the sum rounded, as a separate add
      ss += r.v[s] * r.v[s];
    }
    ss = row_reduce(ss, SumF(), reinterpret_cast<C*>(smem));
    if (!live) return;
    r.write(total_all + base, dim, [&](C v, i64) { return v; });
    const C rs = C(1) / m_sqrt(ss / (C)dim + eps);
    r.write(out + base, dim, [&](C v, i64 j) { return v * rs * (C)load(w[j]); });
    return;
  }
  C ss = C(0);
  if (live)
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
      const T t = store<T>((C)load(x_all[base + j]) + (C)load(d_all[base + j]));
      total_all[base + j] = t;
      const C v = load(t);
      ss += v * v;
    }
  ss = row_reduce(ss, SumF(), reinterpret_cast<C*>(smem));
  if (!live) return;
  const C r = C(1) / m_sqrt(ss / (C)dim + eps);
  for (i64 j = threadIdx.x; j < dim; j += blockDim.x)  // this thread's own writes above
    out[base + j] = store<T>((C)load(total_all[base + j]) * r * (C)load(w[j]));
}

// ---- swiglu: out[r, c] = silu(x[r, c]) * x[r, dim + c], x (rows, 2 * dim) -----------------
template <class T>
__device__ __forceinline__ void swiglu(const T* __restrict__ x, T* __restrict__ out,
                                       const RowParams& p) {
  typedef typename Acc<T>::type C;
  const i64 n = p.rows, dim = p.dim;  // rows carries the number of outputs
  for (i64 i = global_thread(); i < n; i += grid_threads()) {
    const i64 r = i / dim, c = i - r * dim;
    const C a = load(x[2 * dim * r + c]), b = load(x[2 * dim * r + dim + c]);
    out[i] = store<T>(a * sigmoid(a) * b);
  }
}

// ---- attention_decode: one token against the cache, position read from device memory ------
// CUDA implements it as one launch (feature "decode_fused"; the two-kernel form of the
// common ABI is Metal's). Group (KV head h, chunk s) of 128 threads. Latency is what counts
// (a chunk is 16 KiB of keys and values), so the dependent memory round trips are few: after
// the position, the chunk's cached keys and values (positions before p) are loaded into
// registers with 16-byte loads, all in flight together with the queries' loads; the roped
// queries go to shared memory, the group whose chunk holds p writes the roped key and the
// value both to the cache and straight into its staged tile, then the registers are stored
// to the tile. Threads over (head, position) score, a warp per head takes the chunk's max
// and sum of exp, and threads over (head, column) sum p·V. Partials per (query head, chunk)
// are merged by the group that finishes last.
namespace dec {
// row stride of the staged key/value tiles: rows of 2-byte values padded to an odd number of
// 4-byte words, others by one element, so the lanes of a warp (a position each) read
// different banks
template <class T> __host__ __device__ constexpr int tile_stride(int d) {
  return d + (sizeof(T) == 2 ? 2 : 1);
}
constexpr int STAGE_VECS = 8;  // 16-byte vectors of K (and of V) a thread holds in flight

// shared memory: Q (G, D) and S (G, chunk) in C, then the chunk's keys and values (T)
template <class T, class C>
__device__ __forceinline__ void split(const T* __restrict__ qkv, const T* __restrict__ cs,
                                      const T* __restrict__ sn, const int* __restrict__ position,
                                      T* keys, T* values, C* part_o, C* part_ml,
                                      const DecodeParams& p, unsigned char* smem_raw) {
  const i64 pos = position[0];
  if (pos < 0 || pos >= p.capacity || pos >= p.table_rows) return;  // combine writes NaN
  const i64 h = blockIdx.x, s = blockIdx.y, start = s * p.chunk;
  if (start > pos) return;
  const int D = (int)p.head_dim, half = D / 2, G = (int)(p.q_heads / p.kv_heads);
  const int n = (int)((start + p.chunk < pos + 1 ? start + p.chunk : pos + 1) - start);
  const bool holds = pos < start + p.chunk;  // row n - 1 is the new position
  const int cached = holds ? n - 1 : n;      // rows already in the cache
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid % 32, warp = tid / 32;
  const int KS = tile_stride<T>(D), chunk = (int)p.chunk;
  C* Q = reinterpret_cast<C*>(smem_raw);  // (G, D) roped queries
  C* S = Q + G * D;                       // (G, chunk) scores, then exp(score - max)
  T* Kt = reinterpret_cast<T*>(S + G * chunk);  // (chunk, KS) keys of the chunk
  T* Vt = Kt + chunk * KS;                      // (chunk, KS) values
  T* kc = keys + h * p.capacity * D;
  T* vc = values + h * p.capacity * D;
  const T* kbase = kc + start * D;
  const T* vbase = vc + start * D;
  // 1. the cached rows' loads, issued first (16-byte vectors into registers)
  constexpr int V = 16 / sizeof(T);
  const bool vec = D % V == 0 && aligned16(kc) && aligned16(vc);
  const int per_row = D / V, total = vec ? cached * per_row : 0;
  Vec<T, V> kreg[STAGE_VECS], vreg[STAGE_VECS];
#pragma unroll
  for (int u = 0; u < STAGE_VECS; u++) {
    const int idx = tid + u * nt;
    if (idx < total) {
      const int t = idx / per_row, d = (idx % per_row) * V;
      kreg[u] = *reinterpret_cast<const Vec<T, V>*>(kbase + t * D + d);
      vreg[u] = *reinterpret_cast<const Vec<T, V>*>(vbase + t * D + d);
    }
  }
  // 2. roped queries, meanwhile
  const T* c_row = cs + pos * half;
  const T* s_row = sn + pos * half;
  for (int idx = tid; idx < G * half; idx += nt) {
    const int g = idx / half, i = idx % half;
    const T* qh = qkv + (h * G + g) * D;
    const C x1 = load(qh[i]), x2 = load(qh[i + half]);
    const C c = load(c_row[i]), sv = load(s_row[i]);
    Q[g * D + i] = (C)load(store<T>(x1 * c - x2 * sv));  // rounded as rope's output is
    Q[g * D + i + half] = (C)load(store<T>(x2 * c + x1 * sv));
  }
  // 3. the new position's key (roped) and value: to the cache and to the tile's last row
  if (holds) {
    const T* kh = qkv + (p.q_heads + h) * D;
    const T* vh = qkv + (p.q_heads + p.kv_heads + h) * D;
    T* krow = Kt + (n - 1) * KS;
    T* vrow = Vt + (n - 1) * KS;
    for (int i = tid; i < half; i += nt) {
      const C x1 = load(kh[i]), x2 = load(kh[i + half]);
      const C c = load(c_row[i]), sv = load(s_row[i]);
      const T k1 = store<T>(x1 * c - x2 * sv), k2 = store<T>(x2 * c + x1 * sv);
      kc[pos * D + i] = krow[i] = k1;
      kc[pos * D + i + half] = krow[i + half] = k2;
    }
    for (int i = tid; i < D; i += nt) vc[pos * D + i] = vrow[i] = vh[i];
  }
  // 4. the cached rows into the tile: from the registers, or (unaligned or odd head sizes,
  // or more rows than the registers hold) element by element
  auto put = [&](int idx, const Vec<T, V>& kv, const Vec<T, V>& vv) {  // vector idx -> tile
    const int t = idx / per_row, d = (idx % per_row) * V;
#pragma unroll
    for (int e = 0; e < V; e++) {
      Kt[t * KS + d + e] = kv.v[e];
      Vt[t * KS + d + e] = vv.v[e];
    }
  };
#pragma unroll
  for (int u = 0; u < STAGE_VECS; u++)
    if (tid + u * nt < total) put(tid + u * nt, kreg[u], vreg[u]);
  if (vec) {
    for (int idx = tid + STAGE_VECS * nt; idx < total; idx += nt) {
      const int t = idx / per_row, d = (idx % per_row) * V;
      put(idx, *reinterpret_cast<const Vec<T, V>*>(kbase + t * D + d),
          *reinterpret_cast<const Vec<T, V>*>(vbase + t * D + d));
    }
  } else {
    for (int idx = tid; idx < cached * D; idx += nt) {
      const int t = idx / D, d = idx % D;
      Kt[t * KS + d] = kbase[t * D + d];
      Vt[t * KS + d] = vbase[t * D + d];
    }
  }
  __syncthreads();
  const C scale = (C)p.scale + (C)p.scale_lo;
  for (int idx = tid; idx < G * n; idx += nt) {  // a warp: 32 positions of one head
    const int g = idx / n, t = idx % n;
    const C* qg = Q + g * D;
    const T* kr = Kt + t * KS;
    C acc = C(0);
#pragma unroll 8
    for (int d = 0; d < D; d++) acc += qg[d] * (C)load(kr[d]);
    S[g * chunk + t] = acc * scale;
  }
  __syncthreads();
  for (int g = warp; g < G; g += nt / 32) {  // a warp per head: max, exp, sum
    C* sg = S + g * chunk;
    C m = neg_inf<C>();
    for (int t = lane; t < n; t += 32) m = nan_max(m, sg[t]);
    m = warp_max(m);
    C l = C(0);
    for (int t = lane; t < n; t += 32) {
      const C e = m_exp(sg[t] - m);
      sg[t] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) {
      const i64 slot = (h * G + g) * p.splits + s;
      part_ml[slot * 2] = m;
      part_ml[slot * 2 + 1] = l;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < G * D; idx += nt) {  // a warp: 32 columns of one head
    const int g = idx / D, j = idx % D;
    const C* sg = S + g * chunk;
    const T* vcol = Vt + j;
    C acc = C(0);
#pragma unroll 8
    for (int t = 0; t < n; t++) acc += sg[t] * (C)load(vcol[t * KS]);
    part_o[((h * G + g) * p.splits + s) * D + j] = acc;
  }
}

// split() and then, in the group that finishes last for its KV head (a counter per KV head,
// reset by that group), the merge of the group's query heads: one launch instead of two.
// Partials written by other groups are read with ld.cg (L2), after their __threadfence.
// Extra shared memory after split's: weights (G, splits) and sums (G) in C.
template <class T, class C>
__device__ __forceinline__ void fused(const T* __restrict__ qkv, const T* __restrict__ cs,
                                      const T* __restrict__ sn, const int* __restrict__ position,
                                      T* keys, T* values, C* part_o, C* part_ml,
                                      T* __restrict__ out, unsigned* counters,
                                      const DecodeParams& p, unsigned char* smem_raw) {
  const i64 pos = position[0];
  const int D = (int)p.head_dim, G = (int)(p.q_heads / p.kv_heads);
  const i64 h = blockIdx.x;
  if (pos < 0 || pos >= p.capacity || pos >= p.table_rows) {
    if (blockIdx.y == 0)
      for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x)
        out[h * G * D + idx] = store<T>(C(0) / C(0));
    return;
  }
  if ((i64)blockIdx.y * p.chunk > pos) return;  // past the position: not counted
  split<T, C>(qkv, cs, sn, position, keys, values, part_o, part_ml, p, smem_raw);
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  const int used = (int)(pos / p.chunk + 1);
  if (threadIdx.x == 0) last = atomicAdd(counters + h, 1u) == (unsigned)(used - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int chunk = (int)p.chunk, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const size_t tiles = (size_t)G * (D + chunk) * sizeof(C) +
                       2 * (size_t)chunk * tile_stride<T>(D) * sizeof(T);
  C* W = reinterpret_cast<C*>(smem_raw + (tiles + 15) / 16 * 16);  // (G, splits) weights
  C* L = W + G * p.splits;                                          // (G) sums
  for (int g = warp; g < G; g += blockDim.x / 32) {  // a warp per head: weights of the splits
    const C* ml = part_ml + (h * G + g) * p.splits * 2;
    C m = neg_inf<C>(), lsum = C(0);
    if (used <= 32) {  // the common case: one (max, sum) pair per lane, loaded once
      const C mi = lane < used ? __ldcg(ml + lane * 2) : neg_inf<C>();
      const C li = lane < used ? __ldcg(ml + lane * 2 + 1) : C(0);
      m = warp_max(nan_max(m, mi));
      const C w = lane < used ? m_exp(mi - m) : C(0);
      if (lane < used) W[g * p.splits + lane] = w;
      lsum = li * w;
    } else {
      for (int s = lane; s < used; s += 32) m = nan_max(m, __ldcg(ml + s * 2));
      m = warp_max(m);
      for (int s = lane; s < used; s += 32) {
        const C w = m_exp(__ldcg(ml + s * 2) - m);
        W[g * p.splits + s] = w;
        lsum += __ldcg(ml + s * 2 + 1) * w;
      }
    }
    lsum = warp_sum(lsum);
    if (lane == 0) L[g] = lsum;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D, j = idx % D;
    const i64 hq = h * G + g;
    const C* po = part_o + hq * p.splits * D + j;
    const C* wg = W + g * p.splits;
    C o = C(0);
#pragma unroll 8  // eight partial rows in flight per thread
    for (int s = 0; s < used; s++) o += __ldcg(po + (i64)s * D) * wg[s];
    out[hq * D + j] = store<T>(o / L[g]);
  }
  if (threadIdx.x == 0) counters[h] = 0u;  // ready for the next launch
}

}  // namespace dec

// ---- rope: x (batch, seq, heads, head_dim), cos/sin (seq, head_dim/2), half-split ------
template <class T>
__device__ __forceinline__ void rope(const T* __restrict__ x, const T* __restrict__ cs,
                                     const T* __restrict__ sn, T* __restrict__ out,
                                     const RopeParams& p) {
  typedef typename Acc<T>::type C;
  const i64 half = p.head_dim / 2, n = p.batch * p.seq * p.heads * half;
  const i64 t0 = global_thread(), step = grid_threads();
  for (i64 e = t0; e < n; e += step) {
    const i64 i = e % half, q = e / half;
    const i64 s = (q / p.heads) % p.seq;
    const i64 base = q * p.head_dim;
    const C x1 = load(x[base + i]), x2 = load(x[base + i + half]);
    const C c = load(cs[s * half + i]), sv = load(sn[s * half + i]);
    out[base + i] = store<T>(x1 * c - x2 * sv);
    out[base + i + half] = store<T>(x2 * c + x1 * sv);
  }
}

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
  const i64 k_begin = split * p.chunk;
  i64 k_end = k_begin + p.chunk < p.kv_len ? k_begin + p.chunk : p.kv_len;
  if (p.causal) {
    const i64 lim = p.kv_len - p.q_len + max_pos + 1;
    k_end = k_end < lim ? k_end : lim;
  }

  C m[RPW], l[RPW], o[RPW][DPL];
  i64 limit[RPW];
#pragma unroll
  for (int i = 0; i < RPW; i++) {
    m[i] = neg_inf<C>();
    l[i] = C(0);
#pragma unroll
    for (int c = 0; c < DPL; c++) o[i][c] = C(0);
    const i64 row = r0 + warp * RPW + i;
    limit[i] = p.causal ? p.kv_len - p.q_len + row % p.q_len : p.kv_len - 1;
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
      if (key >= k_end || key > limit[i]) s[i] = neg_inf<C>();
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
// params.

namespace fa {
constexpr int BR = 64, BC = 64, THREADS = 128;

using tc::ex2;
using tc::swz;

template <class T, int D>
__device__ __forceinline__ void run(const T* __restrict__ q, const T* __restrict__ k,
                                    const T* __restrict__ v, T* __restrict__ out,
                                    const AttnParams& p, const AttnRows& rows,
                                    unsigned char* smem) {
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
  const T* kbase = k + (b * p.kv_heads + kvh) * p.kv_capacity * D;
  const T* vbase = v + (b * p.kv_heads + kvh) * p.kv_capacity * D;
  auto load_kv = [&](int stage, int tile) {
    const u32 ks = sk + stage * KV_BYTES, vs = sv + stage * KV_BYTES;
#pragma unroll
    for (int i = 0; i < BC * CH / THREADS; i++) {
      const int c = tid + i * THREADS, j = c / CH, ch = c % CH;
      const i64 key = (i64)tile * BC + j;
      const bool ok = key < k_end;
      const i64 off = ok ? key * D + ch * 8 : 0;
      tc::cp_async16(ks + swz<D>(j, ch), kbase + off, ok ? 16 : 0);
      tc::cp_async16(vs + swz<D>(j, ch), vbase + off, ok ? 16 : 0);
    }
  };
  load_kv(0, 0);
  tc::cp_commit();  // group 0: Q and the first K/V tile

  // the last key each of this thread's two rows (g, g + 8 of the warp's 16) may see
  i64 lim[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const i64 row = r0 + warp * 16 + g + 8 * h;
    lim[h] = kv_len - 1;
    if (p.causal && row < rows_total) lim[h] = kv_len - p.q_len + row % p.q_len;
  }
  const i64 lim_min = lim[0] < lim[1] ? lim[0] : lim[1];
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

  for (int it = 0; it < tiles; it++) {
    if (it + 1 < tiles) load_kv((it + 1) & 1, it + 1);
    tc::cp_commit();
    tc::cp_wait<1>();  // all but the newest group: Q and tile `it` have landed
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int kd = 0; kd < KD; kd++)
        tc::ldsm_x4(sq + swz<D>(warp * 16 + (lane & 15), kd * 2 + (lane >> 4)), qf[kd]);
    }
    const u32 ks = sk + (it & 1) * KV_BYTES, vs = sv + (it & 1) * KV_BYTES;

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
    const bool edge = k0 + BC - 1 > lim_min;
#pragma unroll
    for (int j = 0; j < NS; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        s[j][e] *= sl2;
        if (edge && k0 + j * 8 + t4 * 2 + (e & 1) > lim[e >> 1]) s[j][e] = neg_inf<float>();
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
#pragma unroll
    for (int n = 0; n < NO; n++)
      *reinterpret_cast<u32*>(dst + n * 8) = tc::pack2<T>(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
  }
}
}  // namespace fa

// Defined on every target so the names exist; the body needs mma.sync (sm_80+), and the host
// uses these only on such devices (feature "mma").
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FA_BODY(T, D)                                                                          \
  extern __shared__ __align__(128) unsigned char smem[];                                       \
  fa::run<T, D>(q, k, v, out, p, rows, smem);
#else
#define FA_BODY(T, D) __trap();
#endif
#define FA(SFX, T, D)                                                                          \
  extern "C" __global__ void __launch_bounds__(fa::THREADS)                                    \
      attention_tc##D##_##SFX(const T* __restrict__ q, const T* __restrict__ k,                \
                              const T* __restrict__ v, T* __restrict__ out,                    \
                              float* __restrict__ part_o, float* __restrict__ part_ml,         \
                              AttnParams p, AttnRows rows) {                                   \
    pdl_entry();                                                                               \
    FA_BODY(T, D)                                                                              \
  }
ONLY(f16, FA(f16, half_t, 64))
ONLY(bf16, FA(bf16, bf16_t, 64))
ONLY(f16, FA(f16, half_t, 128))
ONLY(bf16, FA(bf16, bf16_t, 128))

#define NN(SFX, T, C)                                                                          \
  extern "C" __global__ void softmax_##SFX(const T* __restrict__ a, T* __restrict__ out, RowParams p) { \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char smem[];                                      \
    softmax_rows<T, false>(a, out, p, smem);                                                   \
  }                                                                                            \
  extern "C" __global__ void log_softmax_##SFX(const T* __restrict__ a, T* __restrict__ out, RowParams p) { \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char smem[];                                      \
    softmax_rows<T, true>(a, out, p, smem);                                                    \
  }                                                                                            \
  extern "C" __global__ void rmsnorm_##SFX(const T* __restrict__ x, const T* __restrict__ w,   \
                                           T* __restrict__ out, NormParams<Scalar<T>::type> p) { \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char smem[];                                      \
    rmsnorm_rows<T>(x, w, out, p.rows, p.dim, p.eps, smem);                                    \
  }                                                                                            \
  extern "C" __global__ void layernorm_##SFX(const T* __restrict__ x, const T* __restrict__ w, \
                                             const T* __restrict__ b, T* __restrict__ out,     \
                                             NormParams<Scalar<T>::type> p) {                  \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char smem[];                                      \
    layernorm_rows<T>(x, w, b, out, p.rows, p.dim, p.eps, smem);                               \
  }                                                                                            \
  extern "C" __global__ void add_rmsnorm_##SFX(const T* x, const T* __restrict__ d,             \
                                               const T* __restrict__ w, T* total,              \
                                               T* __restrict__ out, NormParams<Scalar<T>::type> p) { \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char smem[];                                      \
    add_rmsnorm_rows<T>(x, d, w, total, out, p.rows, p.dim, p.eps, smem);                      \
  }                                                                                            \
  extern "C" __global__ void swiglu_##SFX(const T* __restrict__ x, T* __restrict__ out, RowParams p) { \
    pdl_entry();                                                                               \
    swiglu<T>(x, out, p);                                                                      \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(128)                                            \
      attention_decode_fused_##SFX(const T* __restrict__ qkv, const T* __restrict__ cs,        \
                                   const T* __restrict__ sn, const int* __restrict__ position, \
                                   T* keys, T* values, C* part_o, C* part_ml, T* __restrict__ out, \
                                   unsigned* counters, DecodeParams p) {                       \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char smem[];                                      \
    dec::fused<T, C>(qkv, cs, sn, position, keys, values, part_o, part_ml, out, counters, p, smem); \
  }                                                                                            \
  extern "C" __global__ void rope_##SFX(const T* __restrict__ x, const T* __restrict__ c,      \
                                        const T* __restrict__ s, T* __restrict__ out, RopeParams p) { \
    pdl_entry();                                                                               \
    rope<T>(x, c, s, out, p);                                                                  \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(256)                                            \
      attention_##SFX(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, \
                      T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, \
                      AttnParams p) {                                                          \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char smem[];                                      \
    attn::run<T, C>(q, k, v, out, part_o, part_ml, p, smem);                                   \
  }                                                                                            \
  extern "C" __global__ void attention_combine_##SFX(const float* __restrict__ part_o,         \
                                                     const float* __restrict__ part_ml,        \
                                                     T* __restrict__ out, AttnParams p) {      \
    pdl_entry();                                                                               \
    attn::combine<T>(part_o, part_ml, out, p);                                                 \
  }

ONLY(f16, NN(f16, half_t, float))
ONLY(bf16, NN(bf16, bf16_t, float))
ONLY(f32, NN(f32, float, float))
ONLY(f64, NN(f64, double, double))
