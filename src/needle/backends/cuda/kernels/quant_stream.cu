// The decode step's quantized projections with every weight byte requested at the start
// (sm_90; cuda/quant_stream.py launches them, numpy_ref/quant.py defines the results): the
// same three kernels as quant_decode.cu, for bf16 / f16 x,
//   qstream_norm{8,4}[o]_*    out[j] = (W h)[j],              h = rmsnorm(x) * nw, rounded to T
//   qstream_swiglu{8,4}[o]_*  out[j] = silu(g) * u,  g = (W h)[j], u = (W h)[p + j]
//   qstream_add{8,4}[o]_*     x[j] += (W a)[j], in place (the residual stream)
//
// Why: quant_decode.cu's warps hold a round of weights in registers and ask for the next only
// when it is summed, so a warp's rows cost one dependent memory round trip a round. Here one
// group a multiprocessor owns a contiguous run of output rows, whose packed rows are one
// contiguous run of memory, and thread 0 asks for all of them at the start: a stage (one
// step of NR rows for each warp) a 1-D bulk copy into shared memory (two with SwiGLU: the
// gate rows, the up rows), an mbarrier a stage, and the rows' scales (and offsets) by bulk
// copies too where they are whole 16-byte units, else by the group's 4-byte copies. Meanwhile
// the group stages x as integers (quant_intx.cuh); each lane then holds its chunks of
// x in registers (rows up to 6,144 values), and each warp waits on its stages in order and
// dots its rows with dp4a from shared memory.
//
// Measured (docs/cuda_notes.md v49, an H200): faster where a warp's dot products keep up
// with the stream, i.e. rows of many chunks a lane or one step a warp (a 1.1B down
// projection int4 5.9 -> 5.0 us, int8 7.2 -> 5.8); slower with several steps of short rows
// (1.1B gate/up int4 7.7 -> 8.9 us), where the stream alone takes 6.5 us and the dot
// products alone 6.3. cuda/quant_stream.py chooses; quant_decode.cu takes the rest.
//
// Layout of the dynamic shared memory (cuda/quant_stream.py sizes it the same way), with
// RA = p.rows_per_warp (here: outputs a group) and RT = RA, or 2 RA with SwiGLU (gate rows,
// then up rows):
//   [0, 8 STAGES)           the mbarriers, stage g's at 8 g
//   weights                 RT rows of words u32 (row i of the group at i * words * 4)
//   planes, sx, qsum, red   x as integers: 2k bytes, chunks floats, chunks ints, WARPS floats
//   scales (, offsets)      RT * groups floats each, row-major as in global memory, from the
//                           next 16-byte boundary
#include "common.cuh"
#include "mbarrier.cuh"
#include "quant.cuh"
#include "quant_intx.cuh"
#include "tensor_core.cuh"

namespace qs {
constexpr int WARPS = 8;  // a group's warps
constexpr int STAGES = 16;  // most stages a group: a stage is a step of each warp
constexpr int BARS = 8 * STAGES;  // bytes of barriers
constexpr int XCHUNKS = 6;  // most chunks of x a lane holds in registers: k <= 6,144

__device__ __forceinline__ float* align16(float* p) {  // p rounded up to 16 bytes
  return reinterpret_cast<float*>((reinterpret_cast<u64>(p) + 15) & ~(u64)15);
}

template <class T, int BITS, int KIND, int NR, bool OFF>
__device__ __forceinline__ void qstream(const T* __restrict__ x, const T* __restrict__ nw,
                                        const u32* __restrict__ q, const float* __restrict__ s,
                                        const float* __restrict__ b, T* out,
                                        const QDecodeParams& p, unsigned char* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int E = 128 / BITS, P = IntX<BITS>::P, RW = KIND == 1 ? 2 * NR : NR;
  constexpr int CPL = XCHUNKS * (BITS == 8 ? 2 : 1);  // chunks a lane (k <= 6,144)
  constexpr bool NORM = KIND != 2;
  const int k = (int)p.k, chunks = k / E, groups = (int)p.groups, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const i64 row_bytes = p.words * 4;
  const int RA = (int)p.rows_per_warp, RT = KIND == 1 ? 2 * RA : RA;
  const i64 r0 = (i64)blockIdx.x * RA;
  const int R = (int)(p.p - r0 < RA ? p.p - r0 : RA);  // this group's outputs
  const int steps = (R + NR - 1) / NR;  // stage g: steps g WARPS .. (g + 1) WARPS - 1
  const int stages = (steps + WARPS - 1) / WARPS;

  const u32 bars = tc::smem_u32(smem);
  unsigned char* wsm = smem + BARS;
  uint4* planes = reinterpret_cast<uint4*>(wsm + RT * row_bytes);
  float* sx = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(planes) + 2 * k);
  int* qsum = reinterpret_cast<int*>(sx + chunks);
  float* red = reinterpret_cast<float*>(qsum + chunks);
  float* ssm = align16(red + WARPS);  // (a bulk copy's destination)
  float* osm = ssm + RT * groups;

  // the weights are read after the wait too: a load issued before it can see stale bytes if
  // the previous kernel wrote them (quant_decode.cu)
  pdl_entry();
  const u32 w0 = tc::smem_u32(wsm);
  // the scales (and offsets): by bulk copies counted on the first stage's barrier, which
  // every warp waits on before its first row, where each run is whole 16-byte units (a row's
  // groups a multiple of 4); else by 4-byte asynchronous copies, all in flight at once (a loop
  // of loads and stores took a round trip each, cold)
  const bool bulk_tables = groups % 4 == 0 && aligned16(s) && (!OFF || aligned16(b));
  const u32 run = (u32)(R * groups * 4), parts = KIND == 1 ? 2 : 1;
  // a barrier a stage, then each stage's rows (and its up rows) by one copy each, all at
  // once (asking for a stage only when the one two or three before it had landed, so that
  // the first stages land early, was no faster: docs/cuda_notes.md v49)
  if (tid == 0) {
    for (int g = 0; g < stages; g++) bar_init(bars + 8 * g, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int g = 0; g < stages; g++) {
      const int first = g * WARPS * NR, n = min(WARPS * NR, R - first);
      const u32 bytes = (u32)(n * row_bytes), bar = bars + 8 * g;
      const u32 tables = g == 0 && bulk_tables ? parts * run * (OFF ? 2 : 1) : 0;
      bar_expect_tx(bar, parts * bytes + tables);
      for (u32 part = 0; tables && part < parts; part++) {
        const i64 src = (r0 + (part ? p.p : 0)) * groups;
        const int dst = part * RA * groups;
        bulk_copy(tc::smem_u32(ssm + dst), s + src, run, bar);
        if (OFF) bulk_copy(tc::smem_u32(osm + dst), b + src, run, bar);
      }
      bulk_copy(w0 + (u32)(first * row_bytes), q + (r0 + first) * p.words, bytes, bar);
      if (KIND == 1)  // the up rows, p rows on
        bulk_copy(w0 + (u32)((RA + first) * row_bytes), q + (p.p + r0 + first) * p.words,
                  bytes, bar);
    }
  }
  for (u32 part = 0; !bulk_tables && part < parts; part++) {
    const i64 src = (r0 + (part ? p.p : 0)) * groups;
    const int n = R * groups, dst = part * RA * groups;
    for (int i = tid; i < n; i += WARPS * 32) {
      tc::cp_async4(tc::smem_u32(ssm + dst + i), s + src + i);
      if (OFF) tc::cp_async4(tc::smem_u32(osm + dst + i), b + src + i);
    }
  }
  tc::cp_commit();
  float rs = 1.f;
  if (NORM) {
    const float ss = group_sum_squares<T>(x, k, red, tid, WARPS * 32);
    rs = 1.f / sqrtf(ss / (float)k + p.eps);
  }
  stage_x_int<T, BITS, NORM>(x, nw, rs, k, planes, sx, qsum, tid, WARPS * 32);
  tc::cp_wait<0>();  // this thread's 4-byte scale copies, then (the barrier) everyone's
  __syncthreads();

  // this lane's chunks of x (lane, lane + 32, ..), held for every step
  uint4 xp[CPL][P];
  float xs[CPL];
  int xq[CPL];
#pragma unroll
  for (int u = 0; u < CPL; u++) {
    const int c = lane + 32 * u;
    if (c < chunks) {
#pragma unroll
      for (int pl = 0; pl < P; pl++) xp[u][pl] = planes[pl * chunks + c];
      xs[u] = sx[c];
      xq[u] = qsum[c];
    }
  }

  typedef typename Acc<T>::type C;
  for (int g = 0; g < stages; g++) {
    const int first = (g * WARPS + warp) * NR;
    if (first >= R) break;
    float before[NR];
#pragma unroll
    for (int r = 0; r < NR; r++)  // the residual's old values
      before[r] = KIND == 2 && lane == 0 && first + r < R ? (float)load(out[r0 + first + r]) : 0.f;
    int rows[RW];  // the step's rows in shared memory (past R: the last, never stored)
#pragma unroll
    for (int r = 0; r < RW; r++)
      rows[r] = min(first + r % NR, R - 1) + (KIND == 1 && r >= NR ? RA : 0);
    float acc[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) acc[r] = 0.f;
    bar_wait(bars + 8 * g, 0);
#pragma unroll
    for (int u = 0; u < CPL; u++) {
      const int c = lane + 32 * u;
      if (c >= chunks) break;
      const int gi = scale_group(c, p);
#pragma unroll
      for (int r = 0; r < RW; r++) {
        const uint4 w = *reinterpret_cast<const uint4*>(wsm + rows[r] * row_bytes + 16 * c);
        int dot = chunk_dot_int<BITS>(w, xp[u]);
        if (BITS == 4 && !OFF) dot -= 8 * xq[u];  // symmetric int4: values u - 8
        const float d = xs[u] * (float)dot, scale = ssm[rows[r] * groups + gi];
        const float with_off =  // offsets: + offset * the chunk's sum of x
            OFF ? fmaf(osm[rows[r] * groups + gi], xs[u] * (float)xq[u], acc[r]) : acc[r];
        acc[r] = fmaf(scale, d, with_off);
      }
    }
#pragma unroll
    for (int r = 0; r < RW; r++) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < NR; r++)
        if (first + r < R)
          out[r0 + first + r] =
              projection_out<T, KIND>(acc[r], acc[KIND == 1 ? NR + r : r], (C)before[r]);
    }
  }
#endif
}
}  // namespace qs

// (NR rows a step: 2, SwiGLU 1 gate and up pair)
#define QSTREAM_NORM(NAME, SFX, T, BITS, KIND, NR, OFF, O)                                     \
  extern "C" __global__ void __launch_bounds__(qs::WARPS * 32, 1)                              \
      NAME##BITS##O##_##SFX(const T* __restrict__ x, const T* __restrict__ nw,                  \
                            const u32* __restrict__ q, const float* __restrict__ s,             \
                            const float* __restrict__ b, T* __restrict__ out,                   \
                            QDecodeParams p) {                                                  \
    extern __shared__ __align__(128) unsigned char qstream_smem[];                              \
    qs::qstream<T, BITS, KIND, NR, OFF>(x, nw, q, s, b, out, p, qstream_smem);                  \
  }
#define QSTREAM_ADD(SFX, T, BITS, OFF, O)                                                       \
  extern "C" __global__ void __launch_bounds__(qs::WARPS * 32, 1)                              \
      qstream_add##BITS##O##_##SFX(const T* __restrict__ a, const u32* __restrict__ q,          \
                                   const float* __restrict__ s, const float* __restrict__ b,    \
                                   T* total, QDecodeParams p) {                                 \
    extern __shared__ __align__(128) unsigned char qstream_smem[];                              \
    qs::qstream<T, BITS, 2, 2, OFF>(a, a, q, s, b, total, p, qstream_smem);                     \
  }
#define QSTREAM(SFX, T)                                                                        \
  QPROJECTIONS(QSTREAM_NORM, QSTREAM_ADD, qstream_norm, qstream_swiglu, SFX, T, 8)             \
  QPROJECTIONS(QSTREAM_NORM, QSTREAM_ADD, qstream_norm, qstream_swiglu, SFX, T, 4)

ONLY(f16, QSTREAM(f16, half_t))
ONLY(bf16, QSTREAM(bf16, bf16_t))
