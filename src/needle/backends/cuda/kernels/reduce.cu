// Reductions of a compact (outer, reduce, inner) array over its middle axis: sum, max,
// min, argmax. Rows (inner == 1) go one warp per (row, split) with 16-byte loads and warp
// shuffles; columns (inner > 1) go 32 columns per group, coalesced, its warps splitting the
// reduced axis and meeting in shared memory. Long axes split across groups and a combine
// launch finishes (docs/kernels.md, "reduce").
#include "common.cuh"

struct ReduceParams { i64 outer, reduce, inner, splits, chunk; };

// ---- operations: accumulator type C, identity, and how to fold in a (value, index) --------
template <class C> struct SumOp {
  static constexpr bool kIndex = false;
  __device__ static C init() { return C(0); }
  __device__ static void fold(C& acc, i64&, C v, i64) { acc += v; }
};
template <class C> struct MaxOp {
  static constexpr bool kIndex = false;
  __device__ static C init() { return neg_inf<C>(); }
  __device__ static void fold(C& acc, i64&, C v, i64) { acc = nan_max(acc, v); }
};
template <class C> struct MinOp {
  static constexpr bool kIndex = false;
  __device__ static C init() { return pos_inf<C>(); }
  __device__ static void fold(C& acc, i64&, C v, i64) { acc = nan_min(acc, v); }
};
// first maximum wins; NaN counts as the maximum (numpy.argmax)
template <class C> struct ArgmaxOp {
  static constexpr bool kIndex = true;
  __device__ static C init() { return neg_inf<C>(); }
  __device__ static void fold(C& acc, i64& ai, C v, i64 vi) {
    const bool vn = is_nan(v), an = is_nan(acc);
    const bool better = (vn || an) ? (vn && (!an || vi < ai)) : (v > acc || (v == acc && vi < ai));
    if (better) { acc = v; ai = vi; }
  }
};

template <class Op, class C>
__device__ __forceinline__ void warp_fold(C& acc, i64& ai) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const C v = __shfl_xor_sync(0xffffffffu, acc, o);
    const i64 i = Op::kIndex ? __shfl_xor_sync(0xffffffffu, ai, o) : 0;
    Op::fold(acc, ai, v, i);
  }
}

// the final value: argmax writes the index, the others the accumulator in the output type
template <class Op, class Out, class C> struct Result {
  __device__ static Out get(C acc, i64) { return store<Out>((typename Acc<Out>::type)acc); }
};
template <class C> struct Result<ArgmaxOp<C>, i64, C> {
  __device__ static i64 get(C, i64 ai) { return ai; }
};

template <class Op, class Out, class C>
__device__ __forceinline__ void emit(Out* out, C* part_val, i64* part_idx, const ReduceParams& p,
                                     i64 o, i64 s, i64 c, C acc, i64 ai) {
  if (p.splits == 1) {
    out[o * p.inner + c] = Result<Op, Out, C>::get(acc, ai);
  } else {
    const i64 k = (o * p.splits + s) * p.inner + c;
    part_val[k] = acc;
    if (Op::kIndex) part_idx[k] = ai;
  }
}

static constexpr i64 kNoIndex = 0x7fffffffffffffffll;

template <class Op, class In, class Out, class C>
__device__ __forceinline__ void reduce_rows(const In* __restrict__ in, Out* __restrict__ out,
                                            C* part_val, i64* part_idx, const ReduceParams& p) {
  const i64 o = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  if (o >= p.outer) return;
  const i64 s = blockIdx.y, lane = threadIdx.x;
  const i64 start = s * p.chunk;
  const i64 end = start + p.chunk < p.reduce ? start + p.chunk : p.reduce;
  const In* row = in + o * p.reduce;
  C acc = Op::init();
  i64 ai = kNoIndex;
  i64 r = start;
  constexpr int V = 16 / sizeof(In);
  if (aligned16(row + start)) {
    const i64 nv = (end - start) / V;
    const Vec<In, V>* vrow = reinterpret_cast<const Vec<In, V>*>(row + start);
#pragma unroll 4
    for (i64 k = lane; k < nv; k += 32) {
      const Vec<In, V> x = vrow[k];
#pragma unroll
      for (int j = 0; j < V; j++) Op::fold(acc, ai, (C)load(x.v[j]), start + k * V + j);
    }
    r = start + nv * V;
  }
  for (r += lane; r < end; r += 32) Op::fold(acc, ai, (C)load(row[r]), r);
  warp_fold<Op>(acc, ai);
  if (lane == 0) emit<Op>(out, part_val, part_idx, p, o, s, 0, acc, ai);
}

template <class Op, class In, class Out, class C>
__device__ __forceinline__ void reduce_cols(const In* __restrict__ in, Out* __restrict__ out,
                                            C* part_val, i64* part_idx, const ReduceParams& p,
                                            unsigned char* smem) {
  const i64 blocks = (p.inner + 31) / 32;
  const i64 o = blockIdx.x / blocks, c = (blockIdx.x % blocks) * 32 + threadIdx.x;
  const i64 s = blockIdx.y;
  const i64 start = s * p.chunk;
  const i64 end = start + p.chunk < p.reduce ? start + p.chunk : p.reduce;
  C acc = Op::init();
  i64 ai = kNoIndex;
  if (c < p.inner) {
    const In* col = in + o * p.reduce * p.inner + c;
    // eight rows' loads in flight per thread (the fold stays in row order): with four, a
    // 4096 x 4096 float column sum kept too few bytes in flight to reach the bandwidth
#pragma unroll 8
    for (i64 r = start + threadIdx.y; r < end; r += blockDim.y) Op::fold(acc, ai, (C)load(col[r * p.inner]), r);
  }
  C* sv = reinterpret_cast<C*>(smem);
  i64* si = reinterpret_cast<i64*>(smem + sizeof(C) * 32 * blockDim.y);
  sv[threadIdx.y * 32 + threadIdx.x] = acc;
  si[threadIdx.y * 32 + threadIdx.x] = ai;
  __syncthreads();
  if (threadIdx.y == 0 && c < p.inner) {
    for (int y = 1; y < (int)blockDim.y; y++) Op::fold(acc, ai, sv[y * 32 + threadIdx.x], si[y * 32 + threadIdx.x]);
    emit<Op>(out, part_val, part_idx, p, o, s, c, acc, ai);
  }
}

// Short, wide columns (a few rows of a long array: the split-K slabs of a float32 product,
// a node's gradients summed): a thread per output, grid-stride, its rows' loads in flight
// together; the warp's loads of one row are 32 neighbouring elements. (reduce_cols gave such a sum 65,536 groups of two
// warps meeting in shared memory for one value each: 41 us for two rows of 2M floats.)
template <class Op, class In, class Out, class C>
__device__ __forceinline__ void reduce_wide(const In* __restrict__ in, Out* __restrict__ out,
                                            const ReduceParams& p) {
  const i64 n = p.outer * p.inner, stride = (i64)gridDim.x * blockDim.x;
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
    const i64 o = e / p.inner, c = e - o * p.inner;
    const In* col = in + o * p.reduce * p.inner + c;
    C acc = Op::init();
    i64 ai = kNoIndex;
#pragma unroll 8
    for (i64 r = 0; r < p.reduce; r++) Op::fold(acc, ai, (C)load(col[r * p.inner]), r);
    out[e] = Result<Op, Out, C>::get(acc, ai);
  }
}

template <class Op, class Out, class C>
__device__ __forceinline__ void reduce_combine(const C* __restrict__ part_val, const i64* __restrict__ part_idx,
                                               Out* __restrict__ out, const ReduceParams& p) {
  const i64 e = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  if (e >= p.outer * p.inner) return;
  const i64 o = e / p.inner, c = e - o * p.inner;
  C acc = Op::init();
  i64 ai = kNoIndex;
  for (i64 s = threadIdx.x; s < p.splits; s += 32) {
    const i64 k = (o * p.splits + s) * p.inner + c;
    Op::fold(acc, ai, part_val[k], Op::kIndex ? part_idx[k] : 0);
  }
  warp_fold<Op>(acc, ai);
  if (threadIdx.x == 0) out[e] = Result<Op, Out, C>::get(acc, ai);
}

#define REDUCE(NAME, OPT, SFX, IN, OUT, C)                                                     \
  extern "C" __global__ void reduce_rows_##NAME##_##SFX(const IN* __restrict__ in, OUT* __restrict__ out, \
                                                        C* part_val, i64* part_idx, ReduceParams p) { \
    pdl_entry();                                                                               \
    reduce_rows<OPT<C>, IN, OUT, C>(in, out, part_val, part_idx, p);                           \
  }                                                                                            \
  extern "C" __global__ void reduce_cols_##NAME##_##SFX(const IN* __restrict__ in, OUT* __restrict__ out, \
                                                        C* part_val, i64* part_idx, ReduceParams p) { \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char smem[];                                      \
    reduce_cols<OPT<C>, IN, OUT, C>(in, out, part_val, part_idx, p, smem);                     \
  }                                                                                            \
  extern "C" __global__ void reduce_wide_##NAME##_##SFX(const IN* __restrict__ in,                \
                                                        OUT* __restrict__ out, ReduceParams p) { \
    pdl_entry();                                                                               \
    reduce_wide<OPT<C>, IN, OUT, C>(in, out, p);                                               \
  }                                                                                            \
  extern "C" __global__ void reduce_combine_##NAME##_##SFX(const C* __restrict__ part_val,     \
                                                           const i64* __restrict__ part_idx,   \
                                                           OUT* __restrict__ out, ReduceParams p) { \
    pdl_entry();                                                                               \
    reduce_combine<OPT<C>, OUT, C>(part_val, part_idx, out, p);                                \
  }

ONLY(f16, REDUCE(sum, SumOp, f16, half_t, half_t, float))
ONLY(bf16, REDUCE(sum, SumOp, bf16, bf16_t, bf16_t, float))
ONLY(f32, REDUCE(sum, SumOp, f32, float, float, float))
ONLY(f64, REDUCE(sum, SumOp, f64, double, double, double))
ONLY(i32, REDUCE(sum, SumOp, i32, int, int, i64))
ONLY(i64, REDUCE(sum, SumOp, i64, i64, i64, i64))
ONLY(b8, REDUCE(sum, SumOp, b8, b8, i64, i64))

#define MINMAX(NAME, OPT)                                                                      \
  ONLY(f16, REDUCE(NAME, OPT, f16, half_t, half_t, float))                                                \
  ONLY(bf16, REDUCE(NAME, OPT, bf16, bf16_t, bf16_t, float))                                               \
  ONLY(f32, REDUCE(NAME, OPT, f32, float, float, float))                                                  \
  ONLY(f64, REDUCE(NAME, OPT, f64, double, double, double))                                               \
  ONLY(i32, REDUCE(NAME, OPT, i32, int, int, int))                                                        \
  ONLY(i64, REDUCE(NAME, OPT, i64, i64, i64, i64))
MINMAX(max, MaxOp)
MINMAX(min, MinOp)

ONLY(f16, REDUCE(argmax, ArgmaxOp, f16, half_t, i64, float))
ONLY(bf16, REDUCE(argmax, ArgmaxOp, bf16, bf16_t, i64, float))
ONLY(f32, REDUCE(argmax, ArgmaxOp, f32, float, i64, float))
ONLY(f64, REDUCE(argmax, ArgmaxOp, f64, double, i64, double))
ONLY(i32, REDUCE(argmax, ArgmaxOp, i32, int, i64, int))
ONLY(i64, REDUCE(argmax, ArgmaxOp, i64, i64, i64, i64))
ONLY(b8, REDUCE(argmax, ArgmaxOp, b8, b8, i64, int))
