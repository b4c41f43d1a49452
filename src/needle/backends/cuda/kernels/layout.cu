// Layout kernels: strided gather (compact) and scatter (setitem), and embedding lookup
// (take) with its gradient (scatter_add). See docs/kernels.md, "layout".
#include "common.cuh"

struct Strided {
  i64 n, offset, ndim;
  i64 shape[8], strides[8];
  u32 magic[8], shift[8];
};
template <class S> struct StridedScalar { Strided s; S value; };
struct TakeParams { i64 n_idx, rows, dim; };

// Element offset of logical element i (row-major over shape) in the strided view. Below
// 2^31 elements the division by each extent is a multiply-high (magic numbers from host).
__device__ __forceinline__ i64 strided_offset(const Strided& p, i64 i) {
  i64 off = p.offset;
  const int nd = (int)p.ndim;
  if (p.n < (1ll << 31)) {
    u32 r = (u32)i;
#pragma unroll
    for (int d = 7; d >= 0; d--) {
      if (d < nd) {
        const u32 q = (__umulhi(r, p.magic[d]) + r) >> p.shift[d];
        off += (i64)(r - q * (u32)p.shape[d]) * p.strides[d];
        r = q;
      }
    }
  } else {
#pragma unroll
    for (int d = 7; d >= 0; d--) {
      if (d < nd) {
        const i64 q = i / p.shape[d];
        off += (i - q * p.shape[d]) * p.strides[d];
        i = q;
      }
    }
  }
  return off;
}

template <class T> __device__ __forceinline__ T zero_of() { T z; memset(&z, 0, sizeof(T)); return z; }

#define LAYOUT(SFX, T)                                                                         \
  extern "C" __global__ void compact_##SFX(const T* __restrict__ a, T* __restrict__ out, Strided p) { \
    pdl_entry();                                                                               \
    const i64 t0 = global_thread(), step = grid_threads();                                     \
    for (i64 i = t0; i < p.n; i += step) out[i] = a[strided_offset(p, i)];                     \
  }                                                                                            \
  extern "C" __global__ void setitem_##SFX(const T* __restrict__ a, T* __restrict__ out, Strided p) { \
    pdl_entry();                                                                               \
    const i64 t0 = global_thread(), step = grid_threads();                                     \
    for (i64 i = t0; i < p.n; i += step) out[strided_offset(p, i)] = a[i];                     \
  }                                                                                            \
  extern "C" __global__ void scalar_setitem_##SFX(T* __restrict__ out,                         \
                                                  StridedScalar<Scalar<T>::type> p) {          \
    pdl_entry();                                                                               \
    const T v = store<T>((Acc<T>::type)p.value);                                               \
    const i64 t0 = global_thread(), step = grid_threads();                                     \
    for (i64 i = t0; i < p.s.n; i += step) out[strided_offset(p.s, i)] = v;                    \
  }                                                                                            \
  extern "C" __global__ void transpose_##SFX(const T* __restrict__ a, T* __restrict__ out,     \
                                             TransposeParams p) {                              \
    pdl_entry();                                                                               \
    transpose_tiles<T>(a, out, p);                                                             \
  }

// Transpose: out (count, rows, cols) compact from a source whose matrices are stored
// (cols, rows) row-major at offset + z * batch_stride. 32x32 tiles through shared memory,
// so both the reads and the writes are coalesced (the strided gather of compact is not).
struct TransposeParams { i64 count, rows, cols, batch_stride, offset; };

template <class T>
__device__ __forceinline__ void transpose_tiles(const T* __restrict__ a, T* __restrict__ out,
                                                const TransposeParams& p) {
  __shared__ T tile[32][33];
  const i64 z = blockIdx.z, i0 = (i64)blockIdx.y * 32, j0 = (i64)blockIdx.x * 32;
  const T* src = a + p.offset + z * p.batch_stride;
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const i64 j = j0 + k, i = i0 + threadIdx.x;
    if (j < p.cols && i < p.rows) tile[k][threadIdx.x] = src[j * p.rows + i];
  }
  __syncthreads();
  T* dst = out + z * p.rows * p.cols;
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const i64 i = i0 + k, j = j0 + threadIdx.x;
    if (i < p.rows && j < p.cols) dst[i * p.cols + j] = tile[threadIdx.x][k];
  }
}

// A group per looked-up row (group-stride over rows), its threads across the row, in
// 16-byte vectors when the row length and both buffers allow it.
template <class T, class I>
__device__ __forceinline__ void take_rows(const T* __restrict__ table, const I* __restrict__ idx,
                                          T* __restrict__ out, const TakeParams& p) {
  constexpr int V = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;
  const bool vec = aligned16(table) && aligned16(out) && p.dim % V == 0;
  for (i64 i = blockIdx.x; i < p.n_idx; i += gridDim.x) {
    const i64 r = (i64)idx[i];
    const bool ok = r >= 0 && r < p.rows;
    T* dst = out + i * p.dim;
    const T* src = table + (ok ? r : 0) * p.dim;
    if (vec) {
      Vec<T, V> zero;
      memset(&zero, 0, sizeof(zero));
      for (i64 j = threadIdx.x; j < p.dim / V; j += blockDim.x)
        reinterpret_cast<Vec<T, V>*>(dst)[j] = ok ? reinterpret_cast<const Vec<T, V>*>(src)[j] : zero;
    } else {
      for (i64 j = threadIdx.x; j < p.dim; j += blockDim.x) dst[j] = ok ? src[j] : zero_of<T>();
    }
  }
}

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(int* p, int v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(i64* p, i64 v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v);
}

template <class T, class I>
__device__ __forceinline__ void scatter_rows(const I* __restrict__ idx, const T* __restrict__ values,
                                             T* __restrict__ out, const TakeParams& p) {
  for (i64 i = blockIdx.x; i < p.n_idx; i += gridDim.x) {
    const i64 r = (i64)idx[i];
    if (r < 0 || r >= p.rows) continue;
    for (i64 j = threadIdx.x; j < p.dim; j += blockDim.x) atomic_add(out + r * p.dim + j, values[i * p.dim + j]);
  }
}

// Half precisions, for few indices (the host sends at most 64; more go through a float32
// copy of out): the block of a row's first index sums, in float32 and in index order, out's
// row and the values of every index naming that row, then rounds once, as the reference
// does. One block writes each row, so no atomics; later duplicates skip. This is the decode
// step's write of keys and values into a half-precision cache, without converting it.
template <class T, class I>
__device__ __forceinline__ void scatter_rows_half(const I* __restrict__ idx,
                                                  const T* __restrict__ values,
                                                  T* __restrict__ out, const TakeParams& p) {
  for (i64 i = blockIdx.x; i < p.n_idx; i += gridDim.x) {
    const i64 r = (i64)idx[i];
    if (r < 0 || r >= p.rows) continue;
    bool first = true;
    for (i64 e = 0; e < i && first; e++) first = (i64)idx[e] != r;
    if (!first) continue;  // block-uniform
    for (i64 j = threadIdx.x; j < p.dim; j += blockDim.x) {
      float acc = load(out[r * p.dim + j]);
      for (i64 e = i; e < p.n_idx; e++)
        if ((i64)idx[e] == r) acc += load(values[e * p.dim + j]);
      out[r * p.dim + j] = store<T>(acc);
    }
  }
}

#define TAKE(SFX, T, ISFX, I)                                                                  \
  extern "C" __global__ void take_##SFX##_##ISFX(const T* __restrict__ table, const I* __restrict__ idx, \
                                                 T* __restrict__ out, TakeParams p) {          \
    pdl_entry();                                                                               \
    take_rows(table, idx, out, p);                                                             \
  }
#define SCATTER(SFX, T, ISFX, I)                                                               \
  extern "C" __global__ void scatter_add_##SFX##_##ISFX(const I* __restrict__ idx,             \
                                                        const T* __restrict__ values,          \
                                                        T* __restrict__ out, TakeParams p) {   \
    pdl_entry();                                                                               \
    scatter_rows(idx, values, out, p);                                                         \
  }

#define SCATTER_HALF(SFX, T, ISFX, I)                                                          \
  extern "C" __global__ void scatter_add_##SFX##_##ISFX(const I* __restrict__ idx,             \
                                                        const T* __restrict__ values,          \
                                                        T* __restrict__ out, TakeParams p) {   \
    pdl_entry();                                                                               \
    scatter_rows_half(idx, values, out, p);                                                    \
  }

#define ALL(M) ONLY(f16, M(f16, half_t)) ONLY(bf16, M(bf16, bf16_t)) ONLY(f32, M(f32, float)) \
  ONLY(f64, M(f64, double)) ONLY(i32, M(i32, int)) ONLY(i64, M(i64, i64)) ONLY(b8, M(b8, b8)) \
  ONLY(u8, M(u8, u8_t)) ONLY(i8, M(i8, i8_t))
#define BY_INDEX(M, SFX, T) M(SFX, T, i32, int) M(SFX, T, i64, i64)
#define TAKE_(SFX, T) BY_INDEX(TAKE, SFX, T)
#define SCATTER_(SFX, T) BY_INDEX(SCATTER, SFX, T)

ALL(LAYOUT)
ALL(TAKE_)
ONLY(f16, BY_INDEX(SCATTER_HALF, f16, half_t))
ONLY(bf16, BY_INDEX(SCATTER_HALF, bf16, bf16_t))
ONLY(f32, SCATTER_(f32, float))
ONLY(f64, SCATTER_(f64, double))
ONLY(i32, SCATTER_(i32, int))
ONLY(i64, SCATTER_(i64, i64))
