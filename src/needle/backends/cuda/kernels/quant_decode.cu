// The decode step's fused projections with quantized weights (numpy_ref/quant.py defines
// them; docs/quantization.md the packing; cuda/quant_decode.py launches them), one token:
//   rmsnorm_qmv{8,4}_*         out[j] = (W h)[j],              h = rmsnorm(x) * nw, rounded to T
//   rmsnorm_qmv_swiglu{8,4}_*  out[j] = silu(g) * u,  g = (W h)[j], u = (W h)[p + j]
//   qmv_add{8,4}_*             x[j] += (W a)[j], in place (the residual stream)
// decode.cu's dense kernels read x along with each weight vector; here a 16-byte chunk of
// packed weights holds 16 (int8) or 32 (int4) values, so x (normed, for the first two) is
// staged once per group of 4 warps in shared memory, each thread's loads of x issued
// together: bf16 / f16 x as 16-bit integers with a power-of-two scale a chunk, dotted with the
// packed bytes by dp4a (quant_intx.cuh; with the register caps below, int4 g128 decode went
// from 1.27x to 1.41x bf16's tok/s, v30); float32 x as float, laid out for chunk_dot
// (quant.cuh: group_sum_squares, stage_x). A warp then
// walks its outputs NR at a time (a step); a round asks for U chunks of each of the step's RW
// weight rows (RW = NR, or NR gate and NR up rows) with each chunk's scale (and offset), RW x
// U = 8 loads of 16 bytes per lane, and the next round is asked for as soon as this one's
// registers are summed, so it is in flight during the warp sums and stores.
// Measured (docs/cuda_notes.md v12): bound by instruction issue at the occupancy the 128
// registers allow (3 instructions a value in the float form; ~1 with dp4a), not by bytes in
// flight; two rounds in flight (double-buffered registers) made it slower.
#include "common.cuh"
#include "quant.cuh"
#include "quant_intx.cuh"

// groups of 4 warps per SM the registers must allow, the most without spills: float32 x 4
// (128 registers); 16-bit x (integer dot products) int8 6 (80), int4 5 (96), one fewer with
// offsets (docs/cuda_notes.md v30)
#define QDECODE_GROUPS(T, BITS, OFF) (sizeof(T) == 4 ? 4 : ((BITS) == 8 ? 6 : 5) - (OFF))

namespace qd {
constexpr int WARPS = 4;

// KIND 0: rmsnorm_qmv, 1: rmsnorm_qmv_swiglu, 2: qmv_add. A warp's work is a sequence of
// rounds: step s (outputs first + s NR ..) has `per_step` rounds, round r of it U chunks of
// each of the step's RW weight rows, chunks lane + 32 (U r + u).
template <int BITS, int KIND, int NR, int U, bool OFF>  // OFF: with offsets
struct Round {
  static constexpr int E = 128 / BITS, RW = KIND == 1 ? 2 * NR : NR;
  uint4 w[RW][U];
  float sc[RW][U], off[RW][U];

  // the chunks of round r of the step whose outputs start at j0 (rows past `last` read
  // `last`'s, never stored), with their scales (and offsets)
  __device__ __forceinline__ void fetch(i64 j0, int r, i64 last, int chunks, const u32* q,
                                        const float* s, const float* b,
                                        const QDecodeParams& p) {
    const int c0 = (threadIdx.x & 31) + 32 * U * r;
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      const i64 g = scale_group(c, p);
#pragma unroll
      for (int i = 0; i < RW; i++) {
        const i64 j = j0 + i % NR;
        const i64 row = (j <= last ? j : last) + (KIND == 1 && i >= NR ? p.p : 0);
        w[i][u] = ld_stream16(reinterpret_cast<const uint4*>(q + row * p.words) + c);
        sc[i][u] = __ldg(s + row * p.groups + g);
        if (OFF) off[i][u] = __ldg(b + row * p.groups + g);
      }
    }
  }

  // acc[i] += the round's chunks dotted with the staged h (xsum: each chunk's sum of h)
  __device__ __forceinline__ void dot(int r, int chunks, const float4* xs, const float* xsum,
                                      float magic, float (&acc)[RW]) const {
    const int c0 = (threadIdx.x & 31) + 32 * U * r;
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      const float xsc = OFF ? xsum[c] : 0.f;
#pragma unroll
      for (int i = 0; i < RW; i++) {
        const float d = chunk_dot<BITS>(w[i][u], xs + c, chunks, magic);
        acc[i] = OFF ? fmaf(sc[i][u], d, fmaf(off[i][u], xsc, acc[i]))
                           : fmaf(sc[i][u], d, acc[i]);
      }
    }
  }

  // the same from x staged as integers (quant_intx.cuh; 16-bit activations): a chunk's
  // integer sum, less 8 sum(q) for symmetric int4 (values u - 8), times its scale 2^s
  __device__ __forceinline__ void dot_int(int r, int chunks, const uint4* planes,
                                          const float* sx, const int* xsum,
                                          float (&acc)[RW]) const {
    constexpr int P = IntX<BITS>::P;
    const int c0 = (threadIdx.x & 31) + 32 * U * r;
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      uint4 xp[P];
#pragma unroll
      for (int q = 0; q < P; q++) xp[q] = planes[q * chunks + c];
      const float s = sx[c];
      const int qsum = xsum[c];
      const float xsc = s * (float)qsum;  // the chunk's sum of x, for offsets
#pragma unroll
      for (int i = 0; i < RW; i++) {
        int t = chunk_dot_int<BITS>(w[i][u], xp);
        if (BITS == 4 && !OFF) t -= 8 * qsum;
        const float d = s * (float)t;
        acc[i] = OFF ? fmaf(sc[i][u], d, fmaf(off[i][u], xsc, acc[i]))
                           : fmaf(sc[i][u], d, acc[i]);
      }
    }
  }
};

// one warp's outputs j0 .. j0 + NR - 1 (up to last) from its summed dot products
template <class T, int KIND, int NR, int RW>
__device__ __forceinline__ void finish(float (&acc)[RW], const float (&before)[NR], i64 j0,
                                       i64 last, T* out) {
  typedef typename Acc<T>::type C;
#pragma unroll
  for (int i = 0; i < RW; i++) acc[i] = warp_sum(acc[i]);
  if ((threadIdx.x & 31) != 0) return;
#pragma unroll
  for (int i = 0; i < NR; i++)
    if (j0 + i <= last)
      out[j0 + i] = projection_out<T, KIND>(acc[i], acc[KIND == 1 ? NR + i : i], (C)before[i]);
}

template <class T, int BITS, int KIND, int NR, int U, bool OFF>
__device__ __forceinline__ void qgemv(const T* __restrict__ x, const T* __restrict__ nw,
                                      const u32* __restrict__ q, const float* __restrict__ s,
                                      const float* __restrict__ b, T* out,
                                      const QDecodeParams& p, float* smem) {
  typedef Round<BITS, KIND, NR, U, OFF> R;
  constexpr int E = R::E, RW = R::RW;
  constexpr bool NORM = KIND != 2;
  constexpr bool INTX = sizeof(T) == 2;  // x as integers, dp4a dot products (quant_intx.cuh)
  const int k = (int)p.k, chunks = k / E, lane = threadIdx.x & 31;
  const int per_step = (chunks + 32 * U - 1) / (32 * U);
  const i64 first = ((i64)blockIdx.x * WARPS + (threadIdx.x >> 5)) * p.rows_per_warp;
  const i64 last = (first + p.rows_per_warp < p.p ? first + p.rows_per_warp : p.p) - 1;
  const int rounds = first <= last ? (int)((last - first) / NR + 1) * per_step : 0;
  R ra;  // the round in flight
  auto fetch = [&](int n) {  // the warp's n-th round: step n / per_step, round n % per_step
    ra.fetch(first + (i64)(n / per_step) * NR, n % per_step, last, chunks, q, s, b, p);
  };
  // x (and out, for qmv_add) are the previous kernels' outputs; the weights are read after
  // the wait too, since a load issued before it can see stale bytes if that kernel wrote them
  pdl_entry();
  if (rounds) fetch(0);
  // shared memory: 16-bit activations: x as integers (2k bytes of planes, each chunk's
  // scale and sum: quant_intx.cuh); float32: staged h (k floats), each chunk's sum of h (with
  // offsets); then WARPS floats. cuda/quant_decode.py sizes it.
  uint4* planes = reinterpret_cast<uint4*>(smem);
  float* sx = smem + k / 2;
  int* qsum = reinterpret_cast<int*>(sx + chunks);
  float* xsum = INTX ? reinterpret_cast<float*>(qsum) : smem + k;
  float* red = INTX ? reinterpret_cast<float*>(qsum + chunks) : xsum + (OFF ? chunks : 0);
  float rs = 1.f;
  if (NORM) {
    const float ss = group_sum_squares<T>(x, k, red, threadIdx.x, WARPS * 32);
    rs = 1.f / sqrtf(ss / (float)k + p.eps);
  }
  if constexpr (INTX) {
    stage_x_int<T, BITS, NORM>(x, nw, rs, k, planes, sx, qsum, threadIdx.x, WARPS * 32);
    __syncthreads();
  } else {
    stage_x<T, E, NORM>(x, nw, rs, k, smem, threadIdx.x, WARPS * 32);
    __syncthreads();
    if (OFF) {
      chunk_sums<E>(smem, k, xsum, threadIdx.x, WARPS * 32);
      __syncthreads();
    }
  }
  const float4* xs = reinterpret_cast<const float4*>(smem);
  const float magic = value_magic<BITS>(OFF);
  float acc[RW], before[NR];
  for (int n = 0; n < rounds; n++) {
    const int r = n % per_step;
    const i64 j0 = first + (i64)(n / per_step) * NR;
    if (r == 0) {
#pragma unroll
      for (int i = 0; i < RW; i++) acc[i] = 0.f;
#pragma unroll
      for (int i = 0; i < NR; i++)  // the residual's old values, used when the step ends
        before[i] = KIND == 2 && lane == 0 && j0 + i <= last ? (float)load(out[j0 + i]) : 0.f;
    }
    if constexpr (INTX)
      ra.dot_int(r, chunks, planes, sx, qsum, acc);
    else
      ra.dot(r, chunks, xs, xsum, magic, acc);
    // the next round in flight during the rest (a step's warp sums and stores included)
    if (n + 1 < rounds) fetch(n + 1);
    if (r == per_step - 1) finish<T, KIND, NR, RW>(acc, before, j0, last, out);
  }
}
}  // namespace qd

// (NR, U) = (2, 4), SwiGLU (1, 4): 8 chunk loads of 16 bytes a round per lane. For int4 the
// same (a 2048-wide row is then 2 of a lane's 4 chunks a round): 4 rows x 2 chunks was
// slower on every 1.1B shape but gate/up (docs/cuda_notes.md v12), with half the warps. With
// integer dot products (v30) int4 SwiGLU as 2 gate + 2 up rows x 2 chunks took gate/up 8.2 ->
// 7.3 us on an H200 but 8.8 -> 9.0 on the H100, so (1, 4) stays.
#define QDECODE_NORM(NAME, SFX, T, BITS, KIND, NR, OFF, O)                                      \
  extern "C" __global__ void __launch_bounds__(qd::WARPS * 32, QDECODE_GROUPS(T, BITS, OFF))   \
      NAME##BITS##O##_##SFX(const T* __restrict__ x, const T* __restrict__ nw,                  \
                            const u32* __restrict__ q, const float* __restrict__ s,             \
                            const float* __restrict__ b, T* __restrict__ out,                   \
                            QDecodeParams p) {                                                  \
    extern __shared__ __align__(16) float qdecode_smem[];                                       \
    qd::qgemv<T, BITS, KIND, NR, 4, OFF>(x, nw, q, s, b, out, p, qdecode_smem);                 \
  }
#define QDECODE_ADD(SFX, T, BITS, OFF, O)                                                       \
  extern "C" __global__ void __launch_bounds__(qd::WARPS * 32, QDECODE_GROUPS(T, BITS, OFF))   \
      qmv_add##BITS##O##_##SFX(const T* __restrict__ a, const u32* __restrict__ q,              \
                               const float* __restrict__ s, const float* __restrict__ b,        \
                               T* total, QDecodeParams p) {                                     \
    extern __shared__ __align__(16) float qdecode_smem[];                                       \
    qd::qgemv<T, BITS, 2, 2, 4, OFF>(a, a, q, s, b, total, p, qdecode_smem);                    \
  }
#define QDECODE(SFX, T)                                                                        \
  QPROJECTIONS(QDECODE_NORM, QDECODE_ADD, rmsnorm_qmv, rmsnorm_qmv_swiglu, SFX, T, 8)          \
  QPROJECTIONS(QDECODE_NORM, QDECODE_ADD, rmsnorm_qmv, rmsnorm_qmv_swiglu, SFX, T, 4)

ONLY(f16, QDECODE(f16, half_t))
ONLY(bf16, QDECODE(bf16, bf16_t))
ONLY(f32, QDECODE(f32, float))
