// Matrix products (docs/kernels.md, "matmul").
//  * matmul_{nn,nt,tn,tt}_f32: SIMT fp32, 128x128x16 tiles, 8x8 outputs per thread, the
//    next tile copied (cp.async) or loaded into registers while this one is multiplied
//    (sgemm.cuh); matmul_{nn,nt,tn,tt}64_f32 the same on 128x64 tiles (8x4 a thread:
//    CUDA's products of at most 64 columns).
//  * matmul_{nn,nt,tn,tt}_dmma_f32: float32 products on FP64 tensor cores (sm_90; exact
//    products, float64 sums, one rounding), 128x128x64 tiles in 3 cp.async stages
//    (sgemm_dmma.cuh).
//  * matmul_tc_{f16,bf16} / matmul_tc256_*: tensor cores (mma.sync m16n8k16, fp32
//    accumulate), cp.async multi-stage pipeline, ldmatrix from XOR-swizzled shared memory.
//  * matmul_{dt}: any dtype and layout, 16x16 tiles (the fallback).
//  * gemv_t_* / gemv_n_* / gemv_combine_*: m == 1 (decoding), bandwidth-bound; and
//    matmul_skinny_*: m <= 8 rows (the decode step's probs @ V), split over k (gemv.cuh).
#include "common.cuh"
#include "tensor_core.cuh"

// tuning knobs (NEEDLE_CUDA_OPTIONS="-DSGEMM_MIN_BLOCKS=1 ..." recompiles with others)
#ifndef SGEMM_MIN_BLOCKS
#define SGEMM_MIN_BLOCKS 1  // 2 caps registers at 128 and spills: 39.5 vs 42.2 TFLOP/s (notes)
#endif
#ifndef TC_MIN_BLOCKS
#define TC_MIN_BLOCKS 1
#endif
#ifndef TC_STAGES
#define TC_STAGES 4
#endif
#ifndef WG_STAGES
#define WG_STAGES 4
#endif
#ifndef WG_OVERLAP  // 1: keep one wgmma group in flight across k-tiles (prefetch distance
#define WG_OVERLAP 1  //    WG_STAGES - 2); 0: wait for each tile's wgmma (distance - 1)
#endif

struct MatmulParams { i64 m, n, p, batch, stride_a, stride_b, trans_a, trans_b, splits, chunk; };

// ======================================================================= SIMT fp32 =========
#include "sgemm.cuh"

#define SGEMM(NAME, TA, TB)                                                                    \
  extern "C" __global__ void __launch_bounds__(256, SGEMM_MIN_BLOCKS)                          \
      matmul_##NAME##_f32(const float* __restrict__ a, const float* __restrict__ b,            \
                          float* __restrict__ out, MatmulParams p) {                           \
    pdl_entry();                                                                               \
    sgemm::run<TA, TB, 128>(a, b, out, p);                                                     \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(256)                                            \
      matmul_##NAME##64_f32(const float* __restrict__ a, const float* __restrict__ b,          \
                            float* __restrict__ out, MatmulParams p) {                         \
    pdl_entry();                                                                               \
    sgemm::run<TA, TB, 64>(a, b, out, p);                                                      \
  }
ONLY(f32, SGEMM(nn, false, false))
ONLY(f32, SGEMM(nt, false, true))
ONLY(f32, SGEMM(tn, true, false))
ONLY(f32, SGEMM(tt, true, true))

// ================================================= float32 on FP64 tensor cores =========
#include "sgemm_dmma.cuh"

#define SGEMM_DMMA(NAME, TA, TB)                                                               \
  extern "C" __global__ void __launch_bounds__(256, 1)                                         \
      matmul_##NAME##_dmma_f32(const float* __restrict__ a, const float* __restrict__ b,       \
                               float* __restrict__ out, MatmulParams p) {                      \
    pdl_entry();                                                                               \
    dmma::run<TA, TB>(a, b, out, p);                                                           \
  }
ONLY(f32, SGEMM_DMMA(nn, false, false))
ONLY(f32, SGEMM_DMMA(nt, false, true))
ONLY(f32, SGEMM_DMMA(tn, true, false))
ONLY(f32, SGEMM_DMMA(tt, true, true))

// ================================================================ tensor cores ============
namespace tc {
// A tile [BM][32] (4 chunks of 8 elements per row), chunk c of row r stored at c ^ ((r>>1)&3);
// B tile [32][BN], chunk c of row r stored at c ^ (r&7). Both make ldmatrix conflict-free.
template <class T, int BM, int BN, int WM, int WN, int STAGES>
__device__ __forceinline__ void run(const T* __restrict__ A, const T* __restrict__ B,
                                    T* __restrict__ C, const MatmulParams& p, unsigned char* smem) {
  constexpr int BK = 32, NTHREADS = WM * WN * 32;
  constexpr int WTM = BM / WM, WTN = BN / WN, MT = WTM / 16, NT = WTN / 8;
  constexpr int A_STAGE = BM * BK, B_STAGE = BK * BN;
  T* As = reinterpret_cast<T*>(smem);
  T* Bs = As + STAGES * A_STAGE;
  const i64 M = p.m, K = p.n, N = p.p;
  A += blockIdx.z * p.stride_a;
  B += blockIdx.z * p.stride_b;
  C += blockIdx.z * M * N;
  const i64 m0 = (i64)blockIdx.y * BM, n0 = (i64)blockIdx.x * BN;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / WN, wn = warp % WN;
  const int KT = (int)((K + BK - 1) / BK);

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; i++)
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int q = 0; q < 4; q++) acc[i][j][q] = 0.f;

  auto load_tile = [&](int stage, int kt) {
    const i64 k0 = (i64)kt * BK;
    const u32 as = smem_u32(As + stage * A_STAGE), bs = smem_u32(Bs + stage * B_STAGE);
#pragma unroll
    for (int c = tid; c < BM * 4; c += NTHREADS) {
      const int r = c / 4, ch = c % 4;
      const i64 gm = m0 + r, gk = k0 + ch * 8;
      const bool ok = gm < M && gk < K;
      cp_async16(as + (r * BK + ((ch ^ ((r >> 1) & 3)) * 8)) * 2, ok ? A + gm * K + gk : A, ok ? 16 : 0);
    }
#pragma unroll
    for (int c = tid; c < BK * (BN / 8); c += NTHREADS) {
      const int r = c / (BN / 8), ch = c % (BN / 8);
      const i64 gk = k0 + r, gn = n0 + ch * 8;
      const bool ok = gk < K && gn < N;
      cp_async16(bs + (r * BN + ((ch ^ (r & 7)) * 8)) * 2, ok ? B + gk * N + gn : B, ok ? 16 : 0);
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < KT) load_tile(s, s);
    cp_commit();
  }
  for (int kt = 0; kt < KT; kt++) {
    cp_wait<STAGES - 2>();
    __syncthreads();
    const int nk = kt + STAGES - 1;
    if (nk < KT) load_tile(nk % STAGES, nk);
    cp_commit();
    const int stage = kt % STAGES;
    const u32 as = smem_u32(As + stage * A_STAGE), bs = smem_u32(Bs + stage * B_STAGE);
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      u32 af[MT][4], bf[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        const int r = wm * WTM + mt * 16 + lane % 16, ch = (kk + (lane / 16) * 8) / 8;
        ldsm_x4(as + (r * BK + ((ch ^ ((r >> 1) & 3)) * 8)) * 2, af[mt]);
      }
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        const int r = kk + lane % 16, ch = (wn * WTN + nt * 8 + (lane / 16) * 8) / 8;
        u32 t[4];
        ldsm_x4_t(bs + (r * BN + ((ch ^ (r & 7)) * 8)) * 2, t);
        bf[nt][0] = t[0]; bf[nt][1] = t[1]; bf[nt + 1][0] = t[2]; bf[nt + 1][1] = t[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) Mma<T>::run(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
    }
  }
  cp_wait<0>();

  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const i64 col = n0 + wn * WTN + nt * 8 + 2 * t;
      if (col >= N) continue;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const i64 row = m0 + wm * WTM + mt * 16 + g + h * 8;
        if (row >= M) continue;
        const u32 lo = store<T>(acc[mt][nt][2 * h]).bits, hi = store<T>(acc[mt][nt][2 * h + 1]).bits;
        *reinterpret_cast<u32*>(C + row * N + col) = lo | (hi << 16);
      }
    }
  }
}
}  // namespace tc

#define TC(NAME, SFX, T, BM, BN, WM, WN, STAGES, MINB)                                         \
  extern "C" __global__ void __launch_bounds__(WM * WN * 32, MINB)                             \
      NAME##_##SFX(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,      \
                   MatmulParams p) {                                                           \
    pdl_entry();                                                                               \
    extern __shared__ __align__(128) unsigned char smem[];                                     \
    tc::run<T, BM, BN, WM, WN, STAGES>(a, b, out, p, smem);                                    \
  }
// shared bytes: TC_STAGES * (BM*32 + 32*BN) * 2 (64 KiB and 96 KiB with 4 stages)
ONLY(bf16, TC(matmul_tc, bf16, bf16_t, 128, 128, 2, 4, TC_STAGES, TC_MIN_BLOCKS))
ONLY(f16, TC(matmul_tc, f16, half_t, 128, 128, 2, 4, TC_STAGES, TC_MIN_BLOCKS))
ONLY(bf16, TC(matmul_tc256, bf16, bf16_t, 128, 256, 2, 4, TC_STAGES, 1))
ONLY(f16, TC(matmul_tc256, f16, half_t, 128, 256, 2, 4, TC_STAGES, 1))

// ================================================================ Hopper wgmma ============
// sm_90a only (NVRTC target sm_90a on compute capability 9.0): warpgroup MMA reading both
// operands from shared memory. Both are K-major: A (M, K) row-major and B given as (N, K)
// row-major (the host transposes a (K, N) B first). Tiles 128 x (128*NSUB) x 64: two
// warpgroups of 128 threads, each m64 x n(128*NSUB). Tiles arrive by cp.async, 16-byte
// chunks stored with the 128-byte swizzle (chunk c of row r at c ^ (r & 7), 1024-byte
// aligned), the layout the wgmma descriptors below describe.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace wg {
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pin the accumulators in place around an MMA batch (as CUTLASS does), so the compiler moves
// none of them while a wgmma may still write them; otherwise ptxas serializes (C7514).
template <int NSUB>
__device__ __forceinline__ void fence_operands(float (&acc)[NSUB][64]) {
#pragma unroll
  for (int j = 0; j < NSUB; j++)
#pragma unroll
    for (int q = 0; q < 64; q++) asm volatile("" : "+f"(acc[j][q])::"memory");
}

template <class T, int NSUB, int STAGES>
__device__ __forceinline__ void run(const T* __restrict__ A, const T* __restrict__ B,
                                    T* __restrict__ C, const MatmulParams& p, unsigned char* smem) {
  constexpr int BM = 128, BN = 128 * NSUB, BK = 64;
  constexpr u32 A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
  const u32 base = (tc::smem_u32(smem) + 1023u) & ~1023u;
  const i64 M = p.m, K = p.n, N = p.p;
  A += blockIdx.z * p.stride_a;
  B += blockIdx.z * p.stride_b;
  C += blockIdx.z * M * N;
  const i64 m0 = (i64)blockIdx.y * BM, n0 = (i64)blockIdx.x * BN;
  const int tid = threadIdx.x, group = tid / 128;
  const int KT = (int)((K + BK - 1) / BK);

  float acc[NSUB][64];
#pragma unroll
  for (int j = 0; j < NSUB; j++)
#pragma unroll
    for (int q = 0; q < 64; q++) acc[j][q] = 0.f;

  auto load_tile = [&](int stage, int kt) {
    const i64 k0 = (i64)kt * BK;
    const u32 sa = base + stage * STAGE, sb = sa + A_BYTES;
#pragma unroll
    for (int c = tid; c < BM * 8; c += 256) {
      const int r = c / 8, ch = c % 8;
      const i64 gm = m0 + r, gk = k0 + ch * 8;
      const bool ok = gm < M && gk < K;
      tc::cp_async16(sa + r * 128 + ((ch ^ (r & 7)) * 16), ok ? A + gm * K + gk : A, ok ? 16 : 0);
    }
#pragma unroll
    for (int c = tid; c < BN * 8; c += 256) {
      const int r = c / 8, ch = c % 8;
      const i64 gn = n0 + r, gk = k0 + ch * 8;
      const bool ok = gn < N && gk < K;
      tc::cp_async16(sb + r * 128 + ((ch ^ (r & 7)) * 16), ok ? B + gn * K + gk : B, ok ? 16 : 0);
    }
  };

  // A stage is refilled DIST tiles after it was last read; with WG_OVERLAP the wgmma of the
  // previous tile may still be reading, so refills keep one more stage away.
  constexpr int DIST = STAGES - 1 - WG_OVERLAP;
#pragma unroll
  for (int s = 0; s < DIST; s++) {
    if (s < KT) load_tile(s, s);
    tc::cp_commit();
  }
  for (int kt = 0; kt < KT; kt++) {
    tc::cp_wait<DIST - 1>();
    fence_async_smem();  // cp.async wrote through the generic proxy; wgmma reads through the async one
    __syncthreads();
    const int nk = kt + DIST;
    if (nk < KT) load_tile(nk % STAGES, nk);
    tc::cp_commit();
    const u32 sa = base + (kt % STAGES) * STAGE + group * 64 * 128, sb = base + (kt % STAGES) * STAGE + A_BYTES;
    fence_operands(acc);
    fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
      const u64 da = desc(sa + kk * 32);
#pragma unroll
      for (int j = 0; j < NSUB; j++) Mma<T, 128, false>::run(acc[j], da, desc(sb + j * 128 * 128 + kk * 32));
    }
    commit();
    if (WG_OVERLAP) {
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    } else {
      wait<0>();
    }
    fence_operands(acc);
  }
  wait<0>();
  fence_operands(acc);
  tc::cp_wait<0>();

  // accumulator layout: warp w of the group holds rows 16w..16w+15; per n8 chunk i, lane l
  // holds (row l/4, cols 2(l%4), +1) in d[4i], d[4i+1] and row + 8 in d[4i+2], d[4i+3]
  const int w = (tid % 128) / 32, lane = tid % 32;
  const i64 row0 = m0 + group * 64 + w * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < NSUB; j++) {
#pragma unroll
    for (int i = 0; i < 16; i++) {
      const i64 col = n0 + j * 128 + i * 8 + (lane % 4) * 2;
      if (col >= N) continue;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const i64 row = row0 + h * 8;
        if (row >= M) continue;
        const u32 lo = store<T>(acc[j][4 * i + 2 * h]).bits, hi = store<T>(acc[j][4 * i + 2 * h + 1]).bits;
        *reinterpret_cast<u32*>(C + row * N + col) = lo | (hi << 16);
      }
    }
  }
}
}  // namespace wg
#endif

// Defined on every target so the names exist; their bodies only on sm_90a (the host uses
// them only when the kernels were built for sm_90a).
#define WGMMA(NAME, SFX, T, NSUB)                                                              \
  extern "C" __global__ void __launch_bounds__(256, 1)                                         \
      NAME##_##SFX(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,      \
                   MatmulParams p) {                                                           \
    pdl_entry();                                                                               \
    WGMMA_BODY(T, NSUB)                                                                        \
  }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_BODY(T, NSUB)                                                                    \
  extern __shared__ __align__(1024) unsigned char smem[];                                      \
  wg::run<T, NSUB, WG_STAGES>(a, b, out, p, smem);
#else
#define WGMMA_BODY(T, NSUB) __trap();
#endif
// shared bytes: WG_STAGES * (128 + 128*NSUB) * 64 * 2 + 1024 (alignment slack)
ONLY(bf16, WGMMA(matmul_wgmma, bf16, bf16_t, 2))
ONLY(f16, WGMMA(matmul_wgmma, f16, half_t, 2))
ONLY(bf16, WGMMA(matmul_wgmma128, bf16, bf16_t, 1))
ONLY(f16, WGMMA(matmul_wgmma128, f16, half_t, 1))

// ================================================================ generic ================
template <class T>
__device__ __forceinline__ void matmul_generic(const T* __restrict__ A, const T* __restrict__ B,
                                               T* __restrict__ C, const MatmulParams& p) {
  typedef typename Acc<T>::type Cmp;
  __shared__ Cmp As[16][17], Bs[16][17];
  const i64 M = p.m, K = p.n, N = p.p;
  A += blockIdx.z * p.stride_a;
  B += blockIdx.z * p.stride_b;
  C += blockIdx.z * M * N;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const i64 row = (i64)blockIdx.y * 16 + ty, col = (i64)blockIdx.x * 16 + tx;
  Cmp acc = Cmp(0);
  for (i64 k0 = 0; k0 < K; k0 += 16) {
    const i64 ka = k0 + tx, kb = k0 + ty;
    As[ty][tx] = (row < M && ka < K) ? load(p.trans_a ? A[ka * M + row] : A[row * K + ka]) : Cmp(0);
    Bs[ty][tx] = (kb < K && col < N) ? load(p.trans_b ? B[col * K + kb] : B[kb * N + col]) : Cmp(0);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 16; k++) acc += As[ty][k] * Bs[k][tx];
    __syncthreads();
  }
  if (row < M && col < N) C[row * N + col] = store<T>(acc);
}

// ============================================================ m <= 8 (gemv.cuh) ==========
#include "gemv.cuh"

#define GENERIC(SFX, T)                                                                        \
  extern "C" __global__ void matmul_##SFX(const T* __restrict__ a, const T* __restrict__ b,    \
                                          T* __restrict__ out, MatmulParams p) {               \
    pdl_entry();                                                                               \
    matmul_generic<T>(a, b, out, p);                                                           \
  }
#define GEMV(SFX, T)                                                                           \
  extern "C" __global__ void gemv_t_##SFX(const T* __restrict__ a, const T* __restrict__ b,    \
                                          T* __restrict__ out, MatmulParams p) {               \
    pdl_entry();                                                                               \
    gemv_t<T, 0>(a, b, out, p.n, p.p, 0.f);                                                    \
  }                                                                                            \
  extern "C" __global__ void gemv_t_norm_##SFX(const T* __restrict__ a,                        \
                                               const T* __restrict__ b, T* __restrict__ out,   \
                                               GemvParams p) {                                 \
    pdl_entry();                                                                               \
    gemv_t<T, 1>(a, b, out, p.n, p.p, p.eps);                                                  \
  }                                                                                            \
  extern "C" __global__ void gemv_t_add_##SFX(const T* __restrict__ a,                         \
                                              const T* __restrict__ b, T* __restrict__ out,    \
                                              GemvParams p) {                                  \
    pdl_entry();                                                                               \
    gemv_t<T, 2>(a, b, out, p.n, p.p, 0.f);                                                    \
  }                                                                                            \
  extern "C" __global__ void gemv_glu_##SFX(const T* __restrict__ a, const T* __restrict__ b,  \
                                            T* __restrict__ out, MatmulParams p) {             \
    pdl_entry();                                                                               \
    __shared__ float handed[16];                                                               \
    gemv_glu<T, false>(a, b, out, p.n, p.p, 0.f, handed);                                      \
  }                                                                                            \
  extern "C" __global__ void gemv_geglu_##SFX(const T* __restrict__ a, const T* __restrict__ b, \
                                              T* __restrict__ out, MatmulParams p) {           \
    pdl_entry();                                                                               \
    __shared__ float handed[16];                                                               \
    gemv_glu<T, false, 3>(a, b, out, p.n, p.p, 0.f, handed);                                   \
  }                                                                                            \
  extern "C" __global__ void gemv_glu_norm_##SFX(const T* __restrict__ a,                      \
                                                 const T* __restrict__ b, T* __restrict__ out, \
                                                 GemvParams p) {                               \
    pdl_entry();                                                                               \
    __shared__ float handed[16];                                                               \
    gemv_glu<T, true>(a, b, out, p.n, p.p, p.eps, handed);                                     \
  }                                                                                            \
  extern "C" __global__ void gemv_n_##SFX(const T* __restrict__ a, const T* __restrict__ b,    \
                                          float* __restrict__ part, MatmulParams p) {          \
    pdl_entry();                                                                               \
    extern __shared__ __align__(16) float gemv_smem[];                                         \
    gemv_n<T>(a, b, part, p, gemv_smem);                                                       \
  }                                                                                            \
  extern "C" __global__ void gemv_combine_##SFX(const float* __restrict__ part,                \
                                                T* __restrict__ out, MatmulParams p) {         \
    pdl_entry();                                                                               \
    gemv_combine<T>(part, out, p);                                                             \
  }

ONLY(f16, GENERIC(f16, half_t))
ONLY(bf16, GENERIC(bf16, bf16_t))
ONLY(f32, GENERIC(f32, float))
ONLY(f64, GENERIC(f64, double))
ONLY(i32, GENERIC(i32, int))
ONLY(i64, GENERIC(i64, i64))
#define SKINNY(SFX, T)                                                                         \
  extern "C" __global__ void __launch_bounds__(SKINNY_THREADS)                                 \
      matmul_skinny_##SFX(const T* __restrict__ a, const T* __restrict__ b,                    \
                          T* __restrict__ out, float* __restrict__ part, MatmulParams p) {     \
    pdl_entry();                                                                               \
    __shared__ float red[SKINNY_THREADS / 32 * SKINNY_CG * SKINNY_M * (16 / sizeof(T))];       \
    skinny<T>(a, b, out, part, p, red);                                                        \
  }
ONLY(f16, SKINNY(f16, half_t))
ONLY(bf16, SKINNY(bf16, bf16_t))
ONLY(f32, SKINNY(f32, float))
ONLY(f16, GEMV(f16, half_t))
ONLY(bf16, GEMV(bf16, bf16_t))
ONLY(f32, GEMV(f32, float))
