// float32 matrix products on Hopper's FP64 tensor cores: the body of matmul.cu's
// matmul_{nn,nt,tn,tt}_dmma_f32 (sm_90; the backend takes them for float32 products of
// whole 128 x 128 tiles and k a multiple of 64, enough tiles to fill the SMs twice).
//
// Each float32 operand value becomes a double exactly, so every product is exact and the
// sums are float64: one rounding, to float32, at the end. The result is at least as close
// to the exact product as an IEEE float32 GEMM's (closer: float32 sums round at every
// step), not bitwise equal to one. Why: mma.sync m16n8k16 f64 reaches the H100's FP64
// tensor peak (~66 TFLOP/s) from NVRTC code, the SIMT float32 kernel stops at ~70% of the
// FP32 pipes' (docs/cuda_notes.md v26-v27).
//
// A group of 256 threads (8 warps as 2 along m by 4 along n, a warp 64 x 32 outputs as
// 4 x 4 m16n8 tiles) computes a 128 x 128 tile of C. k runs in tiles of 64 (tiles of 32
// were 1-3% slower, of 16 ~5%) through STAGES cp.async stages of float32 shared memory,
// laid out as the operands are stored (rows padded so that the fragment loads hit 32
// distinct banks); the fragments are converted as they are loaded.
#pragma once
#include "common.cuh"
#include "tensor_core.cuh"

namespace dmma {
constexpr int BM = 128, BN = 128, BK = 64, STAGES = 3, NT = 256;
constexpr int TILE_FLOATS = BM * (BK + 4);  // the larger of an operand tile's two layouts
constexpr int SHARED_BYTES = STAGES * 2 * TILE_FLOATS * 4;  // 208,896: opted in by the host

// One operand tile of ROWS x COLS floats, stored with row stride ld from src, into shared
// memory at dst (a u32 address) with row stride LD: 16-byte copies, 8 a thread.
template <int ROWS, int COLS, int LD>
__device__ __forceinline__ void copy_tile(u32 dst, const float* src, i64 ld) {
  static_assert(ROWS * COLS / 4 % NT == 0, "whole 16-byte copies a thread");
#pragma unroll
  for (int i = 0; i < ROWS * COLS / 4 / NT; i++) {
    const int c = threadIdx.x + i * NT;
    const int r = c / (COLS / 4), q = (c % (COLS / 4)) * 4;
    tc::cp_async16(dst + (r * LD + q) * 4, src + r * ld + q, 16);
  }
}

// Operand element (m, k) of A's tile and (k, n) of B's, in the layout each was copied in:
// A (M, K) as [m][k] with rows of BK + 4; A^T (K, M) as [k][m] with rows of BM + 8; B (K, N)
// as [k][n] with rows of BN + 8; B^T (N, K) as [n][k] with rows of BK + 4.
template <bool TA>
__device__ __forceinline__ double a_at(const float* S, int m, int k) {
  return (double)(TA ? S[k * (BM + 8) + m] : S[m * (BK + 4) + k]);
}
template <bool TB>
__device__ __forceinline__ double b_at(const float* S, int k, int n) {
  return (double)(TB ? S[n * (BK + 4) + k] : S[k * (BN + 8) + n]);
}

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mma(double (&c)[4], const double (&a)[8], const double (&b)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7,%8,%9,%10,%11}, {%12,%13,%14,%15}, {%0,%1,%2,%3};\n"
      : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
        "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
}
#endif

// The 128 x 128 tile of C at group (blockIdx.x, blockIdx.y) of matrix blockIdx.z.
// P: MatmulParams (matmul.cu); p.n is K, p.p is N.
template <bool TA, bool TB, class P>
__device__ __forceinline__ void run(const float* __restrict__ A, const float* __restrict__ B,
                                    float* __restrict__ C, const P& p) {
#if __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) float smem[];
  const i64 M = p.m, K = p.n, N = p.p;
  A += blockIdx.z * p.stride_a;
  B += blockIdx.z * p.stride_b;
  C += blockIdx.z * M * N;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;  // the mma fragments' row group and column pair
  const int wm = (warp / 4) * 64, wn = (warp % 4) * 32;
  const i64 m0 = (i64)blockIdx.y * BM, n0 = (i64)blockIdx.x * BN;
  auto a_tile = [&](int s) { return smem + s * 2 * TILE_FLOATS; };
  auto b_tile = [&](int s) { return smem + s * 2 * TILE_FLOATS + TILE_FLOATS; };
  auto copy = [&](int s, int kt) {
    const i64 k0 = (i64)kt * BK;
    const u32 sa = tc::smem_u32(a_tile(s)), sb = tc::smem_u32(b_tile(s));
    if (TA) copy_tile<BK, BM, BM + 8>(sa, A + k0 * M + m0, M);
    else copy_tile<BM, BK, BK + 4>(sa, A + m0 * K + k0, K);
    if (TB) copy_tile<BN, BK, BK + 4>(sb, B + n0 * K + k0, K);
    else copy_tile<BK, BN, BN + 8>(sb, B + k0 * N + n0, N);
  };
  double acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0;
  const int tiles = (int)(K / BK);
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < tiles) copy(s, s);
    tc::cp_commit();
  }
  for (int kt = 0; kt < tiles; kt++) {
    tc::cp_wait<STAGES - 2>();  // tile kt's copies (this thread's) ...
    __syncthreads();  // ... and everyone's; everyone is done with the stage refilled next
    if (kt + STAGES - 1 < tiles) copy((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
    tc::cp_commit();
    const float* As = a_tile(kt % STAGES);
    const float* Bs = b_tile(kt % STAGES);
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      double b[4][4];  // B fragment of n8 tile j: rows kk + t + 4e, column g
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) b[j][e] = b_at<TB>(Bs, kk + t + 4 * e, wn + 8 * j + g);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        double a[8];  // A fragment of m16 tile i: rows g (+8 for odd e), columns t + 4(e/2)
#pragma unroll
        for (int e = 0; e < 8; e++)
          a[e] = a_at<TA>(As, wm + 16 * i + g + 8 * (e % 2), kk + t + 4 * (e / 2));
#pragma unroll
        for (int j = 0; j < 4; j++) mma(acc[i][j], a, b[j]);
      }
    }
  }
  // accumulator e of tile (i, j): row g (+8 for e >= 2), columns 2t, 2t + 1
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const i64 row = m0 + wm + 16 * i + g + 8 * h, col = n0 + wn + 8 * j + 2 * t;
        *reinterpret_cast<float2*>(C + row * N + col) =
            make_float2((float)acc[i][j][2 * h], (float)acc[i][j][2 * h + 1]);
      }
#else
  __trap();  // sm_90 only: the backend never launches these elsewhere
#endif
}
}  // namespace dmma
