// Products of a few rows with int4 weights on tensor cores (docs/quantization.md): out (m x n)
// = x (m x k) @ W^T for 2 <= m <= 16 rows of x (the tokens of a batched decode step), W int4
// (n x k) in groups of a multiple of 64 (k a multiple of 64) with float32 scales (and
// offsets). quant.cu's qmv reads W once per row of x; this reads it once, as skinny.cu does
// for dense weights, and dequantizes in registers:
//  * A block of 4 warps owns 8 weight rows (8 outputs per token); warp w takes a quarter of
//    the k groups, and the block adds the 4 partial sums at the end.
//  * mma.sync m16n8k16: A = x (token g and g + 8 in a lane's rows; rows past m are zeros),
//    B = the 8 weight rows, one per n column. Lane (g, t) loads 8 bytes of weight row g: 16
//    nibbles, physical k 16t..16t+15 of each 64-k block; MMA i of the block takes word
//    i / 2's nibble pairs (e, e + 4), e = 2(i % 2) and +1, as its B pairs (k 2t, 2t+1) and
//    (2t+8, 2t+9). The sum does not care in which order k runs as long as A and B agree, so
//    x is staged (as T) with each 8 values in the order x0 x4 x1 x5 x2 x6 x3 x7.
//  * A nibble u placed in the mantissa of 128 (bf16: 0x4300 | u) or 1024 (f16: 0x6400 | u)
//    is 128 + u (1024 + u) exactly; one packed FMA subtracts 136 (1032): u - 8, or 128
//    (1024) with offsets: u, exact in T. The products are exact in the fp32 accumulators;
//    each group's sum is scaled once (+ offset * the token's sum of x over the group), then
//    rounded once to T, as qmv's.
#include "common.cuh"
#include "tensor_core.cuh"

// m, n, k, words, groups, group (values), has_offsets
struct QuantSkinnyParams { i64 m, n, k, words, groups, group, has_offsets; };

namespace qsk {
constexpr int WARPS = 4, ROWS = 8, U = 8;  // U: 64-k blocks a lane loads a round

// nibbles e and e + 4 of w as two T values, minus the bias (8, or 0 with offsets)
template <class T, int E> __device__ __forceinline__ u32 nibble_pair(u32 w, u32 bias) {
  typedef tc::Nibbles<T> N;
  return N::fma2(((w >> (4 * E)) & 0x000F000Fu) | N::OR, N::ONE, bias);
}

// TOKENS: 8 (m <= 8: the MMA rows g + 8 are zeros, not staged) or 16
template <class T, int TOKENS>
__device__ __forceinline__ void run(const T* __restrict__ x, const u32* __restrict__ q,
                                    const float* __restrict__ s, const float* __restrict__ b,
                                    T* __restrict__ out, const QuantSkinnyParams& p,
                                    unsigned char* smem) {
  const int k = (int)p.k, m = (int)p.m, groups = (int)p.groups;
  const int blocks_per_group = (int)(p.group / 64), k8 = k / 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const i64 row0 = (i64)blockIdx.x * ROWS, last = p.n - 1;
  const u32* qrow = q + (row0 + g <= last ? row0 + g : last) * p.words;
  const int b0 = warp * groups / WARPS * blocks_per_group;
  const int b1 = (warp + 1) * groups / WARPS * blocks_per_group;
  uint2 w[U];
  // weights and scales only after the wait: the previous kernel may have written them (a
  // load issued before griddepcontrol.wait can read stale bytes)
  pdl_entry();
  auto fetch = [&](int bb) {
#pragma unroll
    for (int u = 0; u < U; u++)
      if (bb + u < b1) w[u] = ld_stream8(reinterpret_cast<const uint2*>(qrow + (bb + u) * 8 + 2 * t));
  };
  fetch(b0);  // in flight while x is staged
  // shared memory: x (TOKENS x k / 8 x 16 bytes), the block's scales (and offsets)
  // [ROWS][groups], each token's sum of x over each group (offsets), the warps' sums
  uint4* xs = reinterpret_cast<uint4*>(smem);
  float* ss = reinterpret_cast<float*>(smem + (size_t)TOKENS * k * 2);
  float* os = ss + ROWS * groups;
  float* xsum = os + (p.has_offsets ? ROWS * groups : 0);
  float* red = xsum + (p.has_offsets ? TOKENS * groups : 0);
  for (int i = tid; i < ROWS * groups; i += WARPS * 32) {
    const int row = i / groups, gi = i % groups;
    const i64 at = (row0 + row <= last ? row0 + row : last) * groups + gi;
    ss[i] = __ldg(s + at);
    if (p.has_offsets) os[i] = __ldg(b + at);
  }
  for (int i = tid; i < TOKENS * k8; i += WARPS * 32) {  // x, 8 values in MMA order
    const int token = i / k8, c = i % k8;
    uint4 o = make_uint4(0u, 0u, 0u, 0u);
    if (token < m) {
      const Vec<T, 8> a = reinterpret_cast<const Vec<T, 8>*>(x + (i64)token * k)[c];
      o.x = (u32)a.v[0].bits | ((u32)a.v[4].bits << 16);
      o.y = (u32)a.v[1].bits | ((u32)a.v[5].bits << 16);
      o.z = (u32)a.v[2].bits | ((u32)a.v[6].bits << 16);
      o.w = (u32)a.v[3].bits | ((u32)a.v[7].bits << 16);
    }
    xs[i] = o;
  }
  __syncthreads();
  if (p.has_offsets) {  // a thread per (token, group): its sum of x, in one order
    const int per_group = (int)p.group / 8;
    for (int i = tid; i < m * groups; i += WARPS * 32) {
      const int token = i / groups, gi = i % groups;
      float sum = 0.f;
      for (int c = 0; c < per_group; c++) {
        const uint4 v = xs[token * k8 + gi * per_group + c];
        const T* x8 = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int e = 0; e < 8; e++) sum += load(x8[e]);
      }
      xsum[i] = sum;
    }
    __syncthreads();
  }
  typedef tc::Nibbles<T> N;
  const u32 bias = p.has_offsets ? N::BIAS_OFF : N::BIAS_SYM;
  // tot[h][j]: token g + 8h, weight row 2t + j; two accumulators (a block's MMAs 0, 1 and 2,
  // 3) halve the dependent chain
  float tot[2][2] = {}, c[4] = {}, d[4] = {};
  int gi = b0 / blocks_per_group, in_group = 0;
  for (int bb = b0; bb < b1; bb += U) {
    if (bb > b0) fetch(bb);
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int blk = bb + u;
      if (blk >= b1) break;
      const uint4 lo0 = xs[g * k8 + blk * 8 + 2 * t], lo1 = xs[g * k8 + blk * 8 + 2 * t + 1];
      uint4 hi0 = make_uint4(0u, 0u, 0u, 0u), hi1 = hi0;
      if (TOKENS == 16) {
        hi0 = xs[(g + 8) * k8 + blk * 8 + 2 * t];
        hi1 = xs[(g + 8) * k8 + blk * 8 + 2 * t + 1];
      }
      const u32 a0[4] = {lo0.x, hi0.x, lo0.y, hi0.y}, a1[4] = {lo0.z, hi0.z, lo0.w, hi0.w};
      const u32 a2[4] = {lo1.x, hi1.x, lo1.y, hi1.y}, a3[4] = {lo1.z, hi1.z, lo1.w, hi1.w};
      tc::Mma<T>::run(c, a0, nibble_pair<T, 0>(w[u].x, bias), nibble_pair<T, 1>(w[u].x, bias));
      tc::Mma<T>::run(c, a1, nibble_pair<T, 2>(w[u].x, bias), nibble_pair<T, 3>(w[u].x, bias));
      tc::Mma<T>::run(d, a2, nibble_pair<T, 0>(w[u].y, bias), nibble_pair<T, 1>(w[u].y, bias));
      tc::Mma<T>::run(d, a3, nibble_pair<T, 2>(w[u].y, bias), nibble_pair<T, 3>(w[u].y, bias));
      if (++in_group == blocks_per_group) {  // the group's sums: scaled (+ offset term)
        in_group = 0;
#pragma unroll
        for (int j = 0; j < 2; j++) {
          const int at = (2 * t + j) * groups + gi;
          const float sc = ss[at];
#pragma unroll
          for (int h = 0; h < 2; h++) {
            tot[h][j] = fmaf(c[2 * h + j] + d[2 * h + j], sc, tot[h][j]);
            if (p.has_offsets && g + 8 * h < m)
              tot[h][j] = fmaf(os[at], xsum[(g + 8 * h) * groups + gi], tot[h][j]);
          }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) c[j] = d[j] = 0.f;
        gi++;
      }
    }
  }
#pragma unroll
  for (int h = 0; h < TOKENS / 8; h++)
#pragma unroll
    for (int j = 0; j < 2; j++) red[(warp * TOKENS + g + 8 * h) * ROWS + 2 * t + j] = tot[h][j];
  __syncthreads();
  const int token = tid / ROWS, row = tid % ROWS;  // 128 threads: every (token, row)
  if (token < m && token < TOKENS && row0 + row <= last) {
    float sum = 0.f;
    for (int wi = 0; wi < WARPS; wi++) sum += red[(wi * TOKENS + token) * ROWS + row];  // one order
    out[(i64)token * p.n + row0 + row] = store<T>(sum);
  }
}
}  // namespace qsk

// qmm4_tc{8,16}_{bf16,f16}: up to 8 or up to 16 rows of x
#define QUANT_SKINNY(SFX, T, TOKENS)                                                           \
  extern "C" __global__ void __launch_bounds__(qsk::WARPS * 32)                                \
      qmm4_tc##TOKENS##_##SFX(const T* __restrict__ x, const u32* __restrict__ q,              \
                              const float* __restrict__ s, const float* __restrict__ b,        \
                              T* __restrict__ out, QuantSkinnyParams p) {                      \
    extern __shared__ __align__(16) unsigned char qsk_smem[];                                  \
    qsk::run<T, TOKENS>(x, q, s, b, out, p, qsk_smem);                                         \
  }
ONLY(f16, QUANT_SKINNY(f16, half_t, 8) QUANT_SKINNY(f16, half_t, 16))
ONLY(bf16, QUANT_SKINNY(bf16, bf16_t, 8) QUANT_SKINNY(bf16, bf16_t, 16))
