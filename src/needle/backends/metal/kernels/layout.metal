// Layout kernels: strided gather (compact) and scatter (setitem, scalar_setitem), embedding
// lookup (take) and its gradient (scatter_add). See docs/kernels.md, "layout".
//
// setitem is also how a device-side KV cache is updated: the cache is one preallocated
// (batch, kv_heads, capacity, head_dim) buffer and each step's keys and values are written
// into a strided view of it in place (docs/metal.md).
#include <metal_stdlib>
using namespace metal;

struct Strided {
  long n, offset, ndim;
  long shape[8], strides[8];
  uint magic[8], shift[8];
};
template <class S>
struct StridedScalar {
  Strided s;
  S value;
};
struct TakeParams {
  long n_idx, rows, dim;
};

// Element offset of logical element i (row-major over shape) in the strided view. Below 2^31
// elements the division by each extent is a multiply-high (magic numbers from the host).
inline long strided_offset(constant Strided& p, long i) {
  long off = p.offset;
  const int nd = int(p.ndim);
  if (p.n < (1l << 31)) {
    uint r = uint(i);
    for (int d = nd - 1; d >= 0; d--) {
      const uint q = (mulhi(r, p.magic[d]) + r) >> p.shift[d];
      off += long(r - q * uint(p.shape[d])) * p.strides[d];
      r = q;
    }
  } else {
    for (int d = nd - 1; d >= 0; d--) {
      const long q = i / p.shape[d];
      off += (i - q * p.shape[d]) * p.strides[d];
      i = q;
    }
  }
  return off;
}

template <class T>
kernel void compact(device const T* a [[buffer(0)]], device T* out [[buffer(1)]],
                    constant Strided& p [[buffer(2)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) { out[i] = a[strided_offset(p, i)]; }
}

template <class T>
kernel void setitem(device const T* a [[buffer(0)]], device T* out [[buffer(1)]],
                    constant Strided& p [[buffer(2)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) { out[strided_offset(p, i)] = a[i]; }
}

template <class T>
kernel void scalar_setitem(device T* out [[buffer(0)]],
                           constant StridedScalar<typename Scalar<T>::type>& p [[buffer(1)]],
                           GRID_ARGS) {
  const T v = store<T>(scalar_value<T>(p.value));
  GRID_STRIDE(i, p.s.n) { out[strided_offset(p.s, i)] = v; }
}

// out[i, :] = table[idx[i], :]; an index outside [0, rows) gives a row of zeros
template <class T, class I>
kernel void take(device const T* table [[buffer(0)]], device const I* idx [[buffer(1)]],
                 device T* out [[buffer(2)]], constant TakeParams& p [[buffer(3)]], GRID_ARGS) {
  GRID_STRIDE(e, p.n_idx * p.dim) {
    const long i = e / p.dim, j = e - i * p.dim;
    const long r = long(idx[i]);
    out[e] = (r >= 0 && r < p.rows) ? table[r * p.dim + j] : T(0);
  }
}

// out[idx[i], :] += values[i, :] with atomics; out-of-range indices are skipped.
// float: compare-and-swap on the bits (atomic float add needs Metal 3); int: atomic add.
inline void atomic_add(device float* p, float v) {
  device atomic_uint* word = (device atomic_uint*)p;
  uint old = atomic_load_explicit(word, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(word, &old, as_type<uint>(as_type<float>(old) + v),
                                                memory_order_relaxed, memory_order_relaxed)) {
  }
}
inline void atomic_add(device int* p, int v) {
  atomic_fetch_add_explicit((device atomic_int*)p, v, memory_order_relaxed);
}

template <class T, class I>
kernel void scatter_add(device const I* idx [[buffer(0)]], device const T* values [[buffer(1)]],
                        device T* out [[buffer(2)]], constant TakeParams& p [[buffer(3)]],
                        GRID_ARGS) {
  GRID_STRIDE(e, p.n_idx * p.dim) {
    const long i = e / p.dim, j = e - i * p.dim;
    const long r = long(idx[i]);
    if (r >= 0 && r < p.rows) atomic_add(out + r * p.dim + j, values[e]);
  }
}

// Metal has no 64-bit atomic add: a thread owns a column and walks the indices in order
// (deterministic, parallel over the row length only).
template <class I>
kernel void scatter_add_columns(device const I* idx [[buffer(0)]],
                                device const long* values [[buffer(1)]],
                                device long* out [[buffer(2)]],
                                constant TakeParams& p [[buffer(3)]], GRID_ARGS) {
  GRID_STRIDE(j, p.dim) {
    for (long i = 0; i < p.n_idx; i++) {
      const long r = long(idx[i]);
      if (r >= 0 && r < p.rows) out[r * p.dim + j] += values[i * p.dim + j];
    }
  }
}

#define LAYOUT(unused, SFX, T)                                                   \
  INSTANTIATE(NAME(compact_##SFX), compact<T>)                                   \
  INSTANTIATE(NAME(setitem_##SFX), setitem<T>)                                   \
  INSTANTIATE(NAME(scalar_setitem_##SFX), scalar_setitem<T>)                     \
  INSTANTIATE(NAME(take_##SFX##_i32), take<T, int>)                              \
  INSTANTIATE(NAME(take_##SFX##_i64), take<T, long>)
ALL(LAYOUT, _)
SMALL_INTS(LAYOUT, _)

INSTANTIATE("scatter_add_f32_i32", scatter_add<float, int>)
INSTANTIATE("scatter_add_f32_i64", scatter_add<float, long>)
INSTANTIATE("scatter_add_i32_i32", scatter_add<int, int>)
INSTANTIATE("scatter_add_i32_i64", scatter_add<int, long>)
INSTANTIATE("scatter_add_i64_i32", scatter_add_columns<int>)
INSTANTIATE("scatter_add_i64_i64", scatter_add_columns<long>)
