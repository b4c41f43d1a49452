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
// laid out as the operands are stored; where B is stored (N, K) (nt, tt), k is reordered
// inside each 16-wide step so that a lane reads four values of a [n][k] or [m][k] row in one
// 16-byte load (below). Every fragment load hits 32 distinct banks; the fragments are
// converted as they are loaded.
#pragma once
#include "common.cuh"
#include "tensor_core.cuh"

namespace dmma {
constexpr int BM = 128, BN = 128, BK = 64, STAGES = 3, NT = 256;
constexpr int TILE_FLOATS = BK * (BM + 8);  // the larger of an operand tile's two layouts
static_assert(BM == BN && BM * BK <= TILE_FLOATS, "the [k][*] layout is the larger");
constexpr int SHARED_BYTES = STAGES * 2 * TILE_FLOATS * 4;  // 208,896: opted in by the host

// The order of k inside each 16-wide step is the kernel's choice (every product is exact
// and the float64 sums' order is immaterial to the float32 result's rounding bounds). With
// PERM, physical k = 4t + c within a step stands at the mma fragments' logical k = t + 4c,
// so a lane's four k values of one row are adjacent and [m][k] / [n][k] tiles are read as
// one 16-byte load a row. PERM is on where B is stored (N, K): nt 0.98-1.00 -> 1.06-1.09x
// cuBLAS's speed, tt 1.02-1.06 -> 1.06-1.12 at 4096³ (two runs); for nn the 16-byte loads
// of A spilled registers and lost 2% (docs/cuda_notes.md v29), so nn and tn keep k in
// order, [m][k] rows of BK + 4.

// Shared-memory row of k-row r of a [k][m] / [k][n] tile: with PERM, within each 16-row
// step the two 2-bit fields of r swapped, so that the lanes reading physical k = 4t + c find
// it at row t + 4c (the rows of BM + 8 floats then put the four t on distinct banks).
template <bool PERM>
__device__ __forceinline__ int k_row(int r) {
  return PERM ? (r & ~15) | ((r >> 2) & 3) | ((r & 3) << 2) : r;
}

// Float offset of (row r, float q) of an [m][k] / [n][k] tile. With PERM rows of BK
// floats, the 16-byte chunk of an odd row XOR 4, so that one 8-lane phase of a 16-byte load
// (rows g and g + 1, four chunks each) covers all 32 banks; else rows of BK + 4 (4-byte
// loads of lanes (g, t) at g * (BK + 4) + t + 4c hit 32 banks).
template <bool PERM>
__device__ __forceinline__ int kmajor_at(int r, int q) {
  return PERM ? r * BK + ((((q >> 2) ^ ((r & 1) << 2))) << 2) + (q & 3) : r * (BK + 4) + q;
}

// One operand tile of ROWS x COLS floats, stored with row stride ld from src, into shared
// memory at dst (a u32 address): [k][*] tiles (K_ROWS) by k_row with rows of COLS + 8,
// [*][k] tiles by kmajor_at. 16-byte copies, 8 a thread.
template <int ROWS, int COLS, bool K_ROWS, bool PERM>
__device__ __forceinline__ void copy_tile(u32 dst, const float* src, i64 ld) {
  static_assert(ROWS * COLS / 4 % NT == 0, "whole 16-byte copies a thread");
#pragma unroll
  for (int i = 0; i < ROWS * COLS / 4 / NT; i++) {
    const int c = threadIdx.x + i * NT;
    const int r = c / (COLS / 4), q = (c % (COLS / 4)) * 4;
    const int at = K_ROWS ? k_row<PERM>(r) * (COLS + 8) + q : kmajor_at<PERM>(r, q);
    tc::cp_async16(dst + at * 4, src + r * ld + q, 16);
  }
}

// With PERM: the four values of physical k = kk + 4t .. kk + 4t + 3 of a [*][k] tile's row,
// from `at` = kmajor_at(row, 4t) with kx = kk ^ ((row & 1) << 4) (kmajor_at's chunk XOR,
// per thread: a lane's rows all share g's parity). The value at logical k = kk + t + 4c of
// a [k][*] tile's column x (rows of X + 8 floats; with PERM physical k = kk + 4t + c is
// stored there). Each made a double.
__device__ __forceinline__ void kmajor4(double (&v)[4], const float* S, int at, int kx) {
  const float4 f = *reinterpret_cast<const float4*>(S + at + kx);
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}
template <int X>
__device__ __forceinline__ double krow_at(const float* S, int kk, int t, int c, int x) {
  return (double)S[(kk + t + 4 * c) * (X + 8) + x];
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
  constexpr bool PERM = TB;  // k reordered: see k_row
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
    if (TA) copy_tile<BK, BM, true, PERM>(sa, A + k0 * M + m0, M);
    else copy_tile<BM, BK, false, PERM>(sa, A + m0 * K + k0, K);
    if (TB) copy_tile<BN, BK, false, PERM>(sb, B + n0 * K + k0, K);
    else copy_tile<BK, BN, true, PERM>(sb, B + k0 * N + n0, N);
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
      const int kx = kk ^ ((g & 1) << 4);  // kmajor_at's chunk XOR for rows of g's parity
      double b[4][4];  // B fragment of n8 tile j: logical k kk + t + 4e, column g
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const int n = wn + 8 * j + g;
        if (TB) {
          kmajor4(b[j], Bs, n * BK + 4 * t, kx);
        } else {
#pragma unroll
          for (int e = 0; e < 4; e++) b[j][e] = krow_at<BN>(Bs, kk, t, e, n);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; i++) {
        // A fragment of m16 tile i: a[2c] row g, a[2c + 1] row g + 8, logical k kk + t + 4c
        double a[8];
        const int m = wm + 16 * i + g;
        if (TA) {
#pragma unroll
          for (int c = 0; c < 4; c++) {
            a[2 * c] = krow_at<BM>(As, kk, t, c, m);
            a[2 * c + 1] = krow_at<BM>(As, kk, t, c, m + 8);
          }
        } else if (PERM) {
          double lo[4], hi[4];
          kmajor4(lo, As, m * BK + 4 * t, kx);
          kmajor4(hi, As, (m + 8) * BK + 4 * t, kx);
#pragma unroll
          for (int c = 0; c < 4; c++) a[2 * c] = lo[c], a[2 * c + 1] = hi[c];
        } else {
#pragma unroll
          for (int c = 0; c < 4; c++) {
            a[2 * c] = (double)As[kmajor_at<false>(m, kk + t + 4 * c)];
            a[2 * c + 1] = (double)As[kmajor_at<false>(m + 8, kk + t + 4 * c)];
          }
        }
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
