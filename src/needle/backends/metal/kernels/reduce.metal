// Reductions of a compact (outer, reduce, inner) array over its middle axis: sum, max, min,
// argmax (docs/kernels.md, "reduce"). Rows (inner == 1): one simd-group per (row, split),
// finished with simd-group functions. Columns (inner > 1): 32 columns per threadgroup, its
// simd-groups splitting the reduced axis and meeting in threadgroup memory; a few rows of
// many columns, a thread per output. Long axes split across threadgroups and a combine
// dispatch finishes.
#include <metal_stdlib>
using namespace metal;

struct ReduceParams {
  long outer, reduce, inner, splits, chunk;
};

constant long kNoIndex = 0x7fffffffffffffffl;

// ---- operations: accumulator type C, identity, how to fold in a (value, index), and whether
// the index matters (only argmax's partials carry one) ------------------------------------
template <class C>
struct Sum {
  static bool indexed() { return false; }
  static C init() { return C(0); }
  static void fold(thread C& acc, thread long&, C v, long) { acc += v; }
};
template <class C>
struct Max {
  static bool indexed() { return false; }
  static C init() { return lowest<C>(); }
  static void fold(thread C& acc, thread long&, C v, long) { acc = nan_max(acc, v); }
};
template <class C>
struct Min {
  static bool indexed() { return false; }
  static C init() { return highest<C>(); }
  static void fold(thread C& acc, thread long&, C v, long) { acc = nan_min(acc, v); }
};
// first maximum wins; NaN counts as the maximum (numpy.argmax)
template <class C>
struct Argmax {
  static bool indexed() { return true; }
  static C init() { return lowest<C>(); }
  static void fold(thread C& acc, thread long& ai, C v, long vi) {
    const bool vn = is_nan(v), an = is_nan(acc);
    const bool better = (vn || an) ? (vn && (!an || vi < ai)) : (v > acc || (v == acc && vi < ai));
    if (better) {
      acc = v;
      ai = vi;
    }
  }
};

// ---- folding across a simd-group: butterfly shuffles, or the simd-group functions ----------
template <class Op, class C>
struct SimdFold {
  static void run(thread C& acc, thread long& ai) {
    for (ushort m = 16; m > 0; m >>= 1) {
      const C v = shuffle_xor(acc, m);
      const long i = shuffle_xor(ai, m);
      Op::fold(acc, ai, v, i);
    }
  }
};
template <>
struct SimdFold<Sum<float>, float> {
  static void run(thread float& acc, thread long&) { acc = simd_sum(acc); }
};
template <>
struct SimdFold<Max<float>, float> {  // simd_max may skip NaN: check for one separately
  static void run(thread float& acc, thread long&) {
    acc = simd_any(is_nan(acc)) ? NAN : simd_max(acc);
  }
};
template <>
struct SimdFold<Min<float>, float> {
  static void run(thread float& acc, thread long&) {
    acc = simd_any(is_nan(acc)) ? NAN : simd_min(acc);
  }
};
template <>
struct SimdFold<Max<int>, int> {
  static void run(thread int& acc, thread long&) { acc = simd_max(acc); }
};
template <>
struct SimdFold<Min<int>, int> {
  static void run(thread int& acc, thread long&) { acc = simd_min(acc); }
};

// the final value: argmax writes the index, the others the accumulator in the output type
template <class Op, class Out, class C>
struct Result {
  static Out get(C acc, long) { return store<Out>(typename Acc<Out>::type(acc)); }
};
template <class C>
struct Result<Argmax<C>, long, C> {
  static long get(C, long ai) { return ai; }
};

template <class Op, class Out, class C>
inline void emit(device Out* out, device C* part_val, device long* part_idx,
                 constant ReduceParams& p, long o, long s, long c, C acc, long ai) {
  if (p.splits == 1) {
    out[o * p.inner + c] = Result<Op, Out, C>::get(acc, ai);
  } else {
    const long k = (o * p.splits + s) * p.inner + c;
    part_val[k] = acc;
    if (Op::indexed()) part_idx[k] = ai;  // otherwise part_idx may alias part_val
  }
}

#define REDUCE_ARGS                                                              \
  uint3 group [[threadgroup_position_in_grid]],                                  \
      uint3 tid [[thread_position_in_threadgroup]],                              \
      uint3 tpg [[threads_per_threadgroup]]

// one simd-group (tid.x = lane) per (row, split): rows o = group.x * TY + tid.y
template <class Op, class In, class Out, class C>
kernel void reduce_rows(device const In* in [[buffer(0)]], device Out* out [[buffer(1)]],
                        device C* part_val [[buffer(2)]], device long* part_idx [[buffer(3)]],
                        constant ReduceParams& p [[buffer(4)]], REDUCE_ARGS) {
  const long o = long(group.x) * tpg.y + tid.y;
  if (o >= p.outer) return;  // the whole simd-group: it is one row
  const long s = group.y;
  const long start = s * p.chunk;
  const long end = lmin(start + p.chunk, p.reduce);
  device const In* row = in + o * p.reduce;
  C acc = Op::init();
  long ai = kNoIndex;
  for (long r = start + tid.x; r < end; r += 32) Op::fold(acc, ai, C(load(row[r])), r);
  SimdFold<Op, C>::run(acc, ai);
  if (tid.x == 0) emit<Op>(out, part_val, part_idx, p, o, s, 0, acc, ai);
}

// 32 columns per threadgroup (tid.x), tid.y splitting the chunk; threadgroup memory holds
// 32 * TY accumulators and then 32 * TY indices
template <class Op, class In, class Out, class C>
kernel void reduce_cols(device const In* in [[buffer(0)]], device Out* out [[buffer(1)]],
                        device C* part_val [[buffer(2)]], device long* part_idx [[buffer(3)]],
                        constant ReduceParams& p [[buffer(4)]],
                        threadgroup uchar* smem [[threadgroup(0)]], REDUCE_ARGS) {
  const long blocks = (p.inner + 31) / 32;
  const long o = group.x / blocks, c = (group.x % blocks) * 32 + tid.x;
  const long s = group.y;
  const long start = s * p.chunk;
  const long end = lmin(start + p.chunk, p.reduce);
  C acc = Op::init();
  long ai = kNoIndex;
  if (c < p.inner) {
    device const In* col = in + o * p.reduce * p.inner + c;
    for (long r = start + tid.y; r < end; r += tpg.y) Op::fold(acc, ai, C(load(col[r * p.inner])), r);
  }
  threadgroup C* sv = (threadgroup C*)smem;
  threadgroup long* si = (threadgroup long*)(smem + sizeof(C) * 32 * tpg.y);
  sv[tid.y * 32 + tid.x] = acc;
  si[tid.y * 32 + tid.x] = ai;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid.y == 0 && c < p.inner) {
    for (uint y = 1; y < tpg.y; y++) Op::fold(acc, ai, sv[y * 32 + tid.x], si[y * 32 + tid.x]);
    emit<Op>(out, part_val, part_idx, p, o, s, c, acc, ai);
  }
}

// Short, wide columns (a few rows of a long array: split-K slabs, a node's gradients summed):
// a thread per output walking its rows, grid-stride (gpu/reduce.py picks it; as CUDA's)
template <class Op, class In, class Out, class C>
kernel void reduce_wide(device const In* in [[buffer(0)]], device Out* out [[buffer(1)]],
                        constant ReduceParams& p [[buffer(2)]], GRID_ARGS) {
  GRID_STRIDE(e, p.outer * p.inner) {
    const long o = e / p.inner, c = e - o * p.inner;
    device const In* col = in + o * p.reduce * p.inner + c;
    C acc = Op::init();
    long ai = kNoIndex;
    for (long r = 0; r < p.reduce; r++) Op::fold(acc, ai, C(load(col[r * p.inner])), r);
    out[e] = Result<Op, Out, C>::get(acc, ai);
  }
}

// one simd-group per output element, its lanes over the splits (In only tells dtypes whose
// combine would otherwise be the same function apart: each host name needs its own)
template <class Op, class In, class Out, class C>
kernel void reduce_combine(device const C* part_val [[buffer(0)]],
                           device const long* part_idx [[buffer(1)]],
                           device Out* out [[buffer(2)]], constant ReduceParams& p [[buffer(3)]],
                           REDUCE_ARGS) {
  const long e = long(group.x) * tpg.y + tid.y;
  if (e >= p.outer * p.inner) return;  // the whole simd-group
  const long o = e / p.inner, c = e - o * p.inner;
  C acc = Op::init();
  long ai = kNoIndex;
  for (long s = tid.x; s < p.splits; s += 32) {
    const long k = (o * p.splits + s) * p.inner + c;
    Op::fold(acc, ai, part_val[k], Op::indexed() ? part_idx[k] : 0);
  }
  SimdFold<Op, C>::run(acc, ai);
  if (tid.x == 0) out[e] = Result<Op, Out, C>::get(acc, ai);
}

#define REDUCE(OP, OPT, SFX, IN, OUT, C)                                         \
  INSTANTIATE(NAME(reduce_rows_##OP##_##SFX), reduce_rows<OPT<C>, IN, OUT, C>)    \
  INSTANTIATE(NAME(reduce_cols_##OP##_##SFX), reduce_cols<OPT<C>, IN, OUT, C>)    \
  INSTANTIATE(NAME(reduce_wide_##OP##_##SFX), reduce_wide<OPT<C>, IN, OUT, C>)    \
  INSTANTIATE(NAME(reduce_combine_##OP##_##SFX), reduce_combine<OPT<C>, IN, OUT, C>)

// (storage type, output type, accumulator) per dtype: sums of integers and bools accumulate
// in long, the others in their compute type
#define FLOAT_REDUCE(OP, OPT, SFX, T) REDUCE(OP, OPT, SFX, T, T, float)
FLOATS(FLOAT_REDUCE, sum, Sum)
REDUCE(sum, Sum, i32, int, int, long)
REDUCE(sum, Sum, i64, long, long, long)
REDUCE(sum, Sum, b8, bool, long, long)

#define MINMAX(OP, OPT)                                                          \
  FLOATS(FLOAT_REDUCE, OP, OPT)                                                  \
  REDUCE(OP, OPT, i32, int, int, int)                                            \
  REDUCE(OP, OPT, i64, long, long, long)
MINMAX(max, Max)
MINMAX(min, Min)

#define FLOAT_ARGMAX(unused, SFX, T) REDUCE(argmax, Argmax, SFX, T, long, float)
FLOATS(FLOAT_ARGMAX, _)
REDUCE(argmax, Argmax, i32, int, long, int)
REDUCE(argmax, Argmax, i64, long, long, long)
REDUCE(argmax, Argmax, b8, bool, long, int)
