// Skinny products on tensor cores (docs/kernels.md, "matmul"): out = X @ W^T for a few rows
// of X (2..128: the tokens of a batched decode step) and a weight matrix W stored (N, K)
// row-major, as every projection of a model is. Like a matrix-vector product it is bound by
// reading W once, so the kernel is shaped around W's stream, not around output tiles:
//
//  * a group of 4 warps owns 64 rows of W (16 per warp) and a slice [k0, k1) of K
//    (blockIdx.y; the host picks the slices so that about one group per SM has work);
//  * its slice is read in 128-wide chunks through two stages: while one chunk is multiplied,
//    every lane's share of the next chunk of W is on its way straight into registers
//    (16-byte streaming loads) and the group's copy of the next chunk of X (all rows, zero
//    past M and k1) into shared memory (cp.async);
//  * mma.sync m16n8k16 with W as the 16x16 A operand and X^T as the 16x8 B operand, one
//    n-tile per 8 rows of X (MT of them). The dot product does not care in which order k is
//    summed, so lane (g = lane / 4, t = lane % 4) loads k = 8t..8t+7 of W rows g and g + 8
//    and of X row g as whole 16-byte vectors and feeds them to two mma's whose logical k
//    pairs (2t, 2t+1) and (2t+8, 2t+9) are physical k 8t+{0,1}, 8t+{2,3} (first) and
//    8t+{4,5}, 8t+{6,7} (second): A and B agree on the permutation, so the products summed
//    are the same;
//  * with one slice the group writes out (rounded once from float32); with several it writes
//    float32 partials part[(split * batch + z) * M + row][col] that matmul.cu's gemv_combine
//    adds in a second launch (spread over the whole GPU: the last group of a row block
//    merging them alone was measured 2x slower end to end).
#include "common.cuh"
#include "tensor_core.cuh"

struct MatmulParams { i64 m, n, p, batch, stride_a, stride_b, trans_a, trans_b, splits, chunk; };

namespace skinny_tc {
constexpr int WARPS = 4, ROWS = 16 * WARPS, KC = 128, SUB = KC / 32;
// shared-memory row stride of an X chunk, in elements: 64 bytes of padding put rows g and
// g + 1 in different banks for the 16-byte reads of one quarter warp
constexpr int STRIDE = KC + 32;

template <class T>
__device__ __forceinline__ void load_w(uint4 (&fa)[SUB], uint4 (&fb)[SUB], const T* wa,
                                       const T* wb, i64 kc, i64 k1, int t) {
  typedef Vec<T, 8> V8;
#pragma unroll
  for (int s = 0; s < SUB; s++) {
    const i64 k = kc + s * 32 + 8 * t;
    if (k < k1) {
      const V8 va = ld_stream(reinterpret_cast<const V8*>(wa + k));
      const V8 vb = ld_stream(reinterpret_cast<const V8*>(wb + k));
      fa[s] = *reinterpret_cast<const uint4*>(&va);
      fb[s] = *reinterpret_cast<const uint4*>(&vb);
    } else {
      fa[s] = fb[s] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// X rows 0..8 * MT - 1, columns kc..kc + KC - 1 into xs (zeros past M and k1); one commit
template <class T, int MT>
__device__ __forceinline__ void stage_x(T* xs, const T* x, i64 M, i64 K, i64 kc, i64 k1) {
  constexpr int VECS = KC / 8;
  for (int i = threadIdx.x; i < MT * 8 * VECS; i += WARPS * 32) {
    const int r = i / VECS, c = i % VECS;
    const i64 k = kc + c * 8;
    const bool live = r < M && k < k1;
    tc::cp_async16(tc::smem_u32(xs + r * STRIDE + c * 8), live ? x + r * K + k : x,
                   live ? 16 : 0);
  }
  tc::cp_commit();
}

template <class T, int MT>
__device__ __forceinline__ void multiply(float (&acc)[MT][4], const uint4 (&fa)[SUB],
                                         const uint4 (&fb)[SUB], const T* xs, int g, int t) {
#pragma unroll
  for (int s = 0; s < SUB; s++) {
    const u32 lo[4] = {fa[s].x, fb[s].x, fa[s].y, fb[s].y};
    const u32 hi[4] = {fa[s].z, fb[s].z, fa[s].w, fb[s].w};
#pragma unroll
    for (int j = 0; j < MT; j++) {
      const uint4 xb = *reinterpret_cast<const uint4*>(xs + (j * 8 + g) * STRIDE + s * 32 + 8 * t);
      tc::Mma<T>::run(acc[j], lo, xb.x, xb.y);
      tc::Mma<T>::run(acc[j], hi, xb.z, xb.w);
    }
  }
}

// Two stages: while chunk c is multiplied (its W in one register set, its X in one buffer),
// chunk c + 1's W loads and X copies are in flight into the other set and buffer.
template <class T, int MT>
__device__ __forceinline__ void run(const T* __restrict__ X, const T* __restrict__ W,
                                    T* __restrict__ out, float* __restrict__ part,
                                    const MatmulParams& p, T* xs0) {
  const i64 M = p.m, K = p.n, N = p.p;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const i64 split = blockIdx.y, z = blockIdx.z;
  const i64 n0 = (i64)blockIdx.x * ROWS + warp * 16;
  const i64 k0 = split * p.chunk, k1 = k0 + p.chunk < K ? k0 + p.chunk : K;
  const T* x = X + z * p.stride_a;
  T* xs1 = xs0 + MT * 8 * STRIDE;
  // rows past N read row N - 1 (their results are not stored)
  const T* wa = W + z * p.stride_b + (n0 + g < N ? n0 + g : N - 1) * K;
  const T* wb = W + z * p.stride_b + (n0 + g + 8 < N ? n0 + g + 8 : N - 1) * K;
  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  uint4 fa0[SUB], fb0[SUB], fa1[SUB], fb1[SUB];
  load_w<T>(fa0, fb0, wa, wb, k0, k1, t);
  stage_x<T, MT>(xs0, x, M, K, k0, k1);
  for (i64 kc = k0; kc < k1; kc += 2 * KC) {
    if (kc + KC < k1) load_w<T>(fa1, fb1, wa, wb, kc + KC, k1, t);
    if (kc + KC < k1) stage_x<T, MT>(xs1, x, M, K, kc + KC, k1); else tc::cp_commit();
    tc::cp_wait<1>();
    __syncthreads();
    multiply<T, MT>(acc, fa0, fb0, xs0, g, t);
    __syncthreads();  // xs0 is refilled next
    if (kc + KC >= k1) break;
    if (kc + 2 * KC < k1) load_w<T>(fa0, fb0, wa, wb, kc + 2 * KC, k1, t);
    if (kc + 2 * KC < k1) stage_x<T, MT>(xs0, x, M, K, kc + 2 * KC, k1); else tc::cp_commit();
    tc::cp_wait<1>();
    __syncthreads();
    multiply<T, MT>(acc, fa1, fb1, xs1, g, t);
    __syncthreads();
  }
  // acc[j]: c0, c1 at W row n0 + g, X rows 8j + 2t, + 1; c2, c3 at W row n0 + g + 8
#pragma unroll
  for (int j = 0; j < MT; j++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const i64 row = j * 8 + 2 * t + (e & 1), col = n0 + g + (e >> 1) * 8;
      if (row >= M || col >= N) continue;
      if (p.splits == 1)
        out[(z * M + row) * N + col] = store<T>(acc[j][e]);
      else
        part[((split * p.batch + z) * M + row) * N + col] = acc[j][e];
    }
}
}  // namespace skinny_tc

#define SKINNY_TC(SFX, T, MT)                                                                  \
  extern "C" __global__ void __launch_bounds__(skinny_tc::WARPS * 32)                          \
      matmul_skinny_tc##MT##_##SFX(const T* __restrict__ x, const T* __restrict__ w,           \
                                   T* __restrict__ out, float* __restrict__ part,              \
                                   MatmulParams p) {                                           \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) unsigned char skinny_smem[];                               \
    skinny_tc::run<T, MT / 8>(x, w, out, part, p,                                    \
                              reinterpret_cast<T*>(skinny_smem));                              \
  }
#define SKINNY_TC_ALL(SFX, T) \
  SKINNY_TC(SFX, T, 8) SKINNY_TC(SFX, T, 16) SKINNY_TC(SFX, T, 32) SKINNY_TC(SFX, T, 64) \
  SKINNY_TC(SFX, T, 128)
ONLY(f16, SKINNY_TC_ALL(f16, half_t))
ONLY(bf16, SKINNY_TC_ALL(bf16, bf16_t))
