// Transformer kernels (docs/kernels.md, "nn"): row kernels (softmax, log_softmax, rmsnorm,
// layernorm, add_rmsnorm, swiglu), rope, and the entry points of three attention kernels
// whose bodies live in headers of their own: flash-style tiles (attention_rows.cuh), split-K
// partials for decoding (attention_decode_split.cuh) and a tensor-core kernel for half
// precisions with head_dim 64 or 128 (attention_tc.cuh).
#include "common.cuh"
#include "attention.cuh"
#include "attention_decode_split.cuh"  // attention_decode_fused
#include "attention_rows.cuh"          // attention, attention_combine
#include "attention_tc.cuh"            // attention_tc
#include "tensor_core.cuh"

struct RowParams { i64 rows, dim; };
template <class S> struct NormParams { i64 rows, dim; S eps; };
struct RopeParams { i64 batch, seq, heads, head_dim; };
template <class S> struct QkNormParams { i64 rows, q_heads, kv_heads, head_dim; S eps; };

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
// x before it writes the same elements of total. With dw (add_rmsnorm_post: Gemma's
// sandwich norms), delta is first replaced by rmsnorm(delta) * dw, rounded as the separate
// rmsnorm rounds it.
template <class T>
__device__ __forceinline__ void add_rmsnorm_rows(const T* x_all, const T* __restrict__ d_all,
                                                 const T* __restrict__ dw,
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
      r.vec = e.vec = false;  // (e.index is read by the post-norm below)
      for (int s = 0; s < CACHE; s++) r.v[s] = e.v[s] = C(0);
    }
    if (dw != nullptr) {  // uniform: the post-norm of delta first
      C sd = C(0);
#pragma unroll
      for (int s = 0; s < CACHE; s++) sd += e.v[s] * e.v[s];
      sd = row_reduce(sd, SumF(), reinterpret_cast<C*>(smem));
      const C rd = C(1) / m_sqrt(sd / (C)dim + eps);
#pragma unroll
      for (int s = 0; s < CACHE; s++) {
        const i64 j = e.index(s);
        e.v[s] = live && j < dim ? (C)load(store<T>(e.v[s] * rd * (C)load(dw[j]))) : C(0);
      }
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
  C rd = C(0);  // the streaming path: delta's post-norm from a first pass over it
  if (dw != nullptr) {
    C sd = C(0);
    if (live)
      for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
        const C v = load(d_all[base + j]);
        sd += v * v;
      }
    rd = C(1) / m_sqrt(row_reduce(sd, SumF(), reinterpret_cast<C*>(smem)) / (C)dim + eps);
  }
  C ss = C(0);
  if (live)
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
      const C d = dw == nullptr ? (C)load(d_all[base + j])
                                : (C)load(store<T>((C)load(d_all[base + j]) * rd *
                                                   (C)load(dw[j])));
      const T t = store<T>((C)load(x_all[base + j]) + d);
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

// ---- qk_rmsnorm: a warp a head row of a fused q/k/v projection: query rows normed with qw,
// key rows with kw (as rmsnorm_rows: float sums, rounded once), value rows copied ----------
template <class T>
__device__ __forceinline__ void qk_rmsnorm(const T* __restrict__ x, const T* __restrict__ qw,
                                           const T* __restrict__ kw, T* __restrict__ out,
                                           const QkNormParams<typename Scalar<T>::type>& p) {
  typedef typename Acc<T>::type C;
  const int lane = threadIdx.x % 32;
  const i64 D = p.head_dim, heads = p.q_heads + 2 * p.kv_heads;
  const i64 warps = (i64)gridDim.x * blockDim.x / 32;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < p.rows; r += warps) {
    const T* xr = x + r * D;
    T* o = out + r * D;
    const i64 h = r % heads;  // the same for the whole warp
    if (h >= p.q_heads + p.kv_heads) {
      for (i64 j = lane; j < D; j += 32) o[j] = xr[j];
      continue;
    }
    const T* w = h < p.q_heads ? qw : kw;
    C ss = C(0);
    for (i64 j = lane; j < D; j += 32) {
      const C v = load(xr[j]);
      ss += v * v;
    }
    ss = warp_sum(ss);
    const C rs = C(1) / m_sqrt(ss / (C)D + (C)p.eps);
    for (i64 j = lane; j < D; j += 32) o[j] = store<T>((C)load(xr[j]) * rs * (C)load(w[j]));
  }
}

// ---- geglu: out[r, c] = gelu_tanh(x[r, c]) * x[r, dim + c] (Gemma's GeGLU) -----------------
template <class T>
__device__ __forceinline__ void geglu(const T* __restrict__ x, T* __restrict__ out,
                                      const RowParams& p) {
  typedef typename Acc<T>::type C;
  const i64 n = p.rows, dim = p.dim;
  for (i64 i = global_thread(); i < n; i += grid_threads()) {
    const i64 r = i / dim, c = i - r * dim;
    const C a = load(x[2 * dim * r + c]), b = load(x[2 * dim * r + dim + c]);
    const C inner = (a + a * a * a * C(0.044715)) * C(0.7978845608028654);
    out[i] = store<T>(a * (tanh(inner) + C(1)) * C(0.5) * b);
  }
}

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


// Defined on every target so the names exist; the body needs mma.sync (sm_80+), and the host
// uses these only on such devices (feature "mma").
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FA_BODY(T, D)                                                                          \
  extern __shared__ __align__(128) unsigned char smem[];                                       \
  const i64 head = p.kv_capacity * D; /* heads-first caches */                                \
  const KVRows kv = {p.kv_heads * head, head, D, p.kv_heads * head, head, D};                  \
  fa::run<T, D>(q, k, v, out, p, rows, kv, nullptr, smem);
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
    add_rmsnorm_rows<T>(x, d, nullptr, w, total, out, p.rows, p.dim, p.eps, smem);             \
  }                                                                                            \
  extern "C" __global__ void add_rmsnorm_post_##SFX(const T* x, const T* __restrict__ d,        \
                                                    const T* __restrict__ dw,                  \
                                                    const T* __restrict__ w, T* total,         \
                                                    T* __restrict__ out,                       \
                                                    NormParams<Scalar<T>::type> p) {           \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char smem[];                                      \
    add_rmsnorm_rows<T>(x, d, dw, w, total, out, p.rows, p.dim, p.eps, smem);                  \
  }                                                                                            \
  extern "C" __global__ void swiglu_##SFX(const T* __restrict__ x, T* __restrict__ out, RowParams p) { \
    pdl_entry();                                                                               \
    swiglu<T>(x, out, p);                                                                      \
  }                                                                                            \
  extern "C" __global__ void qk_rmsnorm_##SFX(const T* __restrict__ x, const T* __restrict__ qw, \
                                              const T* __restrict__ kw, T* __restrict__ out,   \
                                              QkNormParams<Scalar<T>::type> p) {               \
    pdl_entry();                                                                               \
    qk_rmsnorm<T>(x, qw, kw, out, p);                                                          \
  }                                                                                            \
  extern "C" __global__ void geglu_##SFX(const T* __restrict__ x, T* __restrict__ out, RowParams p) { \
    pdl_entry();                                                                               \
    geglu<T>(x, out, p);                                                                       \
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
