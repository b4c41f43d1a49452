// SIMT float32 matrix products (IEEE products, no TF32): the body of matmul.cu's
// matmul_{nn,nt,tn,tt}_f32 (128 x 128 tiles) and matmul_*64_f32 (128 x 64 tiles).
//
// A group of 256 threads computes a 128 x W tile of C, each thread 8 x (W / 16) outputs
// (rows ty*4.. and 64 + ty*4.., columns tx*4.. and 64 + tx*4..), k in tiles of 16 through
// two shared-memory buffers holding each operand as [k][m] (or [k][n]): tile t + 1 arrives
// while tile t is multiplied. An operand stored along m (A^T, B) is copied into its buffer
// by cp.async 16-byte copies (sm_80+); one stored along k (A, B^T) is loaded into
// registers and stored transposed after tile t's products. Groups whose tiles lie wholly
// inside aligned matrices ("inside") load through pointers worked out once, with no
// bounds; the others (and every group before sm_80) load with bounds, through registers.
// docs/cuda_notes.md v25 has what each choice was worth.
#pragma once
#include "common.cuh"
#include "tensor_core.cuh"

namespace sgemm {
constexpr int BM = 128, BK = 16, NT = 256;
constexpr int PAD = 4;  // a [k][m] row's padding where transposing stores fill it
#if __CUDA_ARCH__ >= 800
constexpr bool ASYNC = true;  // cp.async
#else
constexpr bool ASYNC = false;
#endif

// ---------------------------------------------------------------- through registers ----
// Fetch this thread's share of an operand tile of R rows (m or n: 128, or 64 for the narrow
// kernels) by BK k's into registers: R / 64 float4. !TA: X is (M, K) row-major, contiguous
// along k; TA: X is (K, M), contiguous along m. K is the row length (stride); kend bounds
// the k range of this group (split-K).
template <bool TA, int R>
__device__ __forceinline__ void fetch_a(const float* A, i64 M, i64 K, i64 kend, i64 m0, i64 k0,
                                        bool vec, float4 (&r)[R / 64]) {
#pragma unroll
  for (int i = 0; i < R / 64; i++) {
    const int c = threadIdx.x + i * NT;
    // the 4 values lie along X's contiguous dimension: entries run..run+3 (of runs) of row
    // `row` (of rows), rows ld floats apart
    const i64 gm = !TA ? m0 + c / 4 : m0 + (c % (R / 4)) * 4;
    const i64 gk = !TA ? k0 + (c % 4) * 4 : k0 + c / (R / 4);
    const i64 row = TA ? gk : gm, rows = TA ? kend : M, run = TA ? gm : gk;
    const i64 runs = TA ? M : kend, ld = TA ? M : K;
    float v[4];
    if (vec) {
      float4 x = (row < rows && run < runs) ? *reinterpret_cast<const float4*>(A + row * ld + run)
                                           : make_float4(0.f, 0.f, 0.f, 0.f);
      v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; j++)
        v[j] = (row < rows && run + j < runs) ? A[row * ld + run + j] : 0.f;
    }
    r[i] = make_float4(v[0], v[1], v[2], v[3]);
  }
}

// The same loads for a group wholly inside the matrices: fetch_a's addresses worked out
// once (at k0), each tile moving them by step; no bounds, no 64-bit index products a tile.
template <bool TA, int R>
__device__ __forceinline__ i64 first_fetch(const float* A, i64 M, i64 K, i64 m0, i64 k0,
                                           const float* (&at)[R / 64]) {
#pragma unroll
  for (int i = 0; i < R / 64; i++) {
    const int c = threadIdx.x + i * NT;
    at[i] = !TA ? A + (m0 + c / 4) * K + k0 + (c % 4) * 4
                : A + (k0 + c / (R / 4)) * M + m0 + (c % (R / 4)) * 4;
  }
  return TA ? BK * M : BK;
}
template <int R>
__device__ __forceinline__ void fetch_inside(const float* (&at)[R / 64], i64 step,
                                             float4 (&r)[R / 64]) {
#pragma unroll
  for (int i = 0; i < R / 64; i++) {
    r[i] = *reinterpret_cast<const float4*>(at[i]);
    at[i] += step;
  }
}

// S[k][m]: for !TA the 4 values are 4 k's of one row; for TA 4 m's of one k.
template <bool TA, int R>
__device__ __forceinline__ void stash_a(float (*S)[R + PAD], const float4 (&r)[R / 64]) {
#pragma unroll
  for (int i = 0; i < R / 64; i++) {
    const int c = threadIdx.x + i * NT;
    if (!TA) {
      const int m = c / 4, k = (c % 4) * 4;
      S[k][m] = r[i].x; S[k + 1][m] = r[i].y; S[k + 2][m] = r[i].z; S[k + 3][m] = r[i].w;
    } else {
      const int k = c / (R / 4), m = (c % (R / 4)) * 4;
      *reinterpret_cast<float4*>(&S[k][m]) = r[i];
    }
  }
}

// ------------------------------------------------------------------------ products ----
// acc += a b^T for one k, in 2 x 2 blocks (a row pair by a column pair) whose row pairs
// snake down and up a quad of rows (the order cuBLAS's SIMT kernels issue): consecutive
// FFMAs share a factor. Each acc[i][j] still sums its k's in order, so the order of the
// FFMAs does not change a bit of the result.
template <int NB>
__device__ __forceinline__ void products(const float (&a)[8], const float (&b)[NB],
                                         float (&acc)[8][NB]) {
#pragma unroll
  for (int q = 0; q < 2; q++)
#pragma unroll
    for (int jp = 0; jp < NB / 2; jp++)
#pragma unroll
      for (int ip = 0; ip < 2; ip++) {
        const int i0 = 4 * q + 2 * ((ip + jp) & 1);
#pragma unroll
        for (int di = 0; di < 2; di++)
#pragma unroll
          for (int dj = 0; dj < 2; dj++)
            acc[i0 + di][2 * jp + dj] =
                fmaf(a[i0 + di], b[2 * jp + dj], acc[i0 + di][2 * jp + dj]);
      }
}

// Row (or column) h * 64 + ty * 4 of a [k][m] tile for one k: 4 values a float4.
template <int NH>
__device__ __forceinline__ void row_k(const float* row, int t4, float (&v)[4 * NH]) {
#pragma unroll
  for (int h = 0; h < NH; h++) {
    const float4 x = *reinterpret_cast<const float4*>(row + 64 * h + t4);
    v[4 * h] = x.x; v[4 * h + 1] = x.y; v[4 * h + 2] = x.z; v[4 * h + 3] = x.w;
  }
}

// One tile of BK k's: A from As ([k][m], rows LA floats), B from Bs ([k][n], rows LB).
template <int LA, int LB, int NH>
__device__ __forceinline__ void multiply(const float* As, const float* Bs,
                                         float (&acc)[8][4 * NH]) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
  for (int k = 0; k < BK; k++) {
    float a[8], b[4 * NH];
    row_k<2>(As + k * LA, ty * 4, a);
    row_k<NH>(Bs + k * LB, tx * 4, b);
    products<4 * NH>(a, b, acc);
  }
}

// ------------------------------------------------------------------- copies ----
// This thread's R / 64 16-byte chunks of a [k][m] tile (TA: X stored (K, M)), copied into
// shared memory S (a u32 shared address, rows R floats), then moved one k tile on.
template <int R>
__device__ __forceinline__ void copy_tile(const float* (&xt)[R / 64], i64 step, u32 S) {
#pragma unroll
  for (int i = 0; i < R / 64; i++) {
    const u32 c = threadIdx.x + i * NT;
    tc::cp_async16(S + ((c / (R / 4)) * R + (c % (R / 4)) * 4) * 4, xt[i], 16);
    xt[i] += step;
  }
}

// -------------------------------------------------------------------- the k loop ----
// INSIDE: every load of the group in bounds and aligned, the k range whole tiles.
template <bool TA, bool TB, int W, bool INSIDE>
__device__ __forceinline__ void k_loop(const float* A, const float* B, i64 M, i64 K, i64 N,
                                       i64 kbeg, i64 kend, i64 m0, i64 n0, bool vec_a,
                                       bool vec_b, float* smem, float (&acc)[8][4 * (W / 64)]) {
  constexpr int NH = W / 64;
  constexpr bool COPY_A = INSIDE && ASYNC && TA, COPY_B = INSIDE && ASYNC && !TB;
  constexpr int LA = BM + (COPY_A ? 0 : PAD), LB = W + (COPY_B ? 0 : PAD);
  float* As = smem;                 // [2][BK][LA]
  float* Bs = smem + 2 * BK * LA;   // [2][BK][LB]
  const float* at[2];
  const float* bt[NH];
  i64 step_a = 0, step_b = 0;
  if constexpr (INSIDE) {
    step_a = first_fetch<TA, BM>(A, M, K, m0, kbeg, at);
    step_b = first_fetch<!TB, W>(B, N, K, n0, kbeg, bt);  // B (K, N) has A^T's shape
  }
  float4 ra[2], rb[NH];
  auto copy = [&](int buf) {  // the copied operands of the next tile into buf
    if constexpr (COPY_A) copy_tile<BM>(at, step_a, tc::smem_u32(As + buf * BK * LA));
    if constexpr (COPY_B) copy_tile<W>(bt, step_b, tc::smem_u32(Bs + buf * BK * LB));
    if constexpr (COPY_A || COPY_B) tc::cp_commit();
  };
  auto fetch = [&](int t) {  // the others into registers
    if constexpr (INSIDE) {
      if constexpr (!COPY_A) fetch_inside<BM>(at, step_a, ra);
      if constexpr (!COPY_B) fetch_inside<W>(bt, step_b, rb);
    } else {
      const i64 k0 = kbeg + (i64)t * BK;
      fetch_a<TA, BM>(A, M, K, kend, m0, k0, vec_a, ra);
      fetch_a<!TB, W>(B, N, K, kend, n0, k0, vec_b, rb);
    }
  };
  auto stash = [&](int buf) {  // ... then into buf, transposed where stored along k
    using RowA = float(*)[LA];
    using RowB = float(*)[LB];
    if constexpr (!COPY_A) stash_a<TA, BM>(reinterpret_cast<RowA>(As + buf * BK * LA), ra);
    if constexpr (!COPY_B) stash_a<!TB, W>(reinterpret_cast<RowB>(Bs + buf * BK * LB), rb);
  };
  const int tiles = (int)((kend - kbeg + BK - 1) / BK);
  copy(0);
  fetch(0);
  stash(0);
  for (int t = 0; t < tiles; t++) {
    const bool next = t + 1 < tiles;
    if constexpr (COPY_A || COPY_B) tc::cp_wait<0>();  // tile t's copies (this thread's) ...
    __syncthreads();  // ... and everyone's have landed; everyone is done with buffer t - 1
    if (next) {
      copy((t + 1) & 1);
      fetch(t + 1);
    }
    multiply<LA, LB, NH>(As + (t & 1) * BK * LA, Bs + (t & 1) * BK * LB, acc);
    if (next) stash((t + 1) & 1);
  }
}

// A 128 x W tile of C (see the header comment). P: MatmulParams (matmul.cu).
template <bool TA, bool TB, int W, class P>
__device__ __forceinline__ void run(const float* __restrict__ A, const float* __restrict__ B,
                                    float* __restrict__ C, const P& p) {
  constexpr int NH = W / 64;
  __shared__ __align__(16) float smem[2 * BK * (BM + PAD) + 2 * BK * (W + PAD)];
  const i64 M = p.m, K = p.n, N = p.p;
  // blockIdx.z = split * batch + matrix: split-K groups write partial products to C's
  // split-th slab (a workspace; the host sums the slabs), others write C itself
  const i64 zb = blockIdx.z % p.batch, zs = blockIdx.z / p.batch;
  A += zb * p.stride_a;
  B += zb * p.stride_b;
  C += blockIdx.z * M * N;
  const i64 kbeg = zs * p.chunk, kend = p.splits > 1 && kbeg + p.chunk < K ? kbeg + p.chunk : K;
  const i64 m0 = (i64)blockIdx.y * BM, n0 = (i64)blockIdx.x * W;
  const bool vec_a = aligned16(A) && (TA ? M : K) % 4 == 0;
  const bool vec_b = aligned16(B) && (TB ? K : N) % 4 == 0;
  const bool inside = vec_a && vec_b && m0 + BM <= M && n0 + W <= N && kend > kbeg &&
                      (kend - kbeg) % BK == 0;

  float acc[8][4 * NH];
#pragma unroll
  for (int i = 0; i < 8; i++)
#pragma unroll
    for (int j = 0; j < 4 * NH; j++) acc[i][j] = 0.f;

  if (inside)
    k_loop<TA, TB, W, true>(A, B, M, K, N, kbeg, kend, m0, n0, vec_a, vec_b, smem, acc);
  else
    k_loop<TA, TB, W, false>(A, B, M, K, N, kbeg, kend, m0, n0, vec_a, vec_b, smem, acc);

  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  const bool vec_c = N % 4 == 0;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const i64 row = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
    if (row >= M) continue;
#pragma unroll
    for (int h = 0; h < NH; h++) {
      const i64 col = n0 + h * 64 + tx * 4;
      float* dst = C + row * N + col;
      const float* v = &acc[i][h * 4];
      if (vec_c && col < N) {
        *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
          if (col + j < N) dst[j] = v[j];
      }
    }
  }
}
}  // namespace sgemm
