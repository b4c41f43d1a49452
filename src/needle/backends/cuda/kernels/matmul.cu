// Matrix products (docs/kernels.md, "matmul").
//  * matmul_{nn,nt,tn,tt}_f32: SIMT fp32, 128x128x16 tiles, 8x8 outputs per thread, the
//    next tile copied (cp.async) or loaded into registers while this one is multiplied
//    (sgemm.cuh); matmul_{nn,nt,tn,tt}64_f32 the same on 128x64 tiles (8x4 a thread:
//    CUDA's products of at most 64 columns).
//  * matmul_tc_{f16,bf16} / matmul_tc256_*: tensor cores (mma.sync m16n8k16, fp32
//    accumulate), cp.async multi-stage pipeline, ldmatrix from XOR-swizzled shared memory.
//  * matmul_{dt}: any dtype and layout, 16x16 tiles (the fallback).
//  * gemv_t_* / gemv_n_* / gemv_combine_*: m == 1 (decoding), bandwidth-bound.
//  * matmul_skinny_*: m <= 8 rows (the decode step's probs @ V), split over k.
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

// ================================================================ m == 1 ================
// out[j] = sum_k a[k] * B[j][k]: B stored (p, n); a warp per output, 16-byte loads along k.
// Bandwidth-bound (decoding streams every weight once per token), so each lane issues
// GEMV_UNROLL independent 16-byte loads of its row before using any (a 2048-long bf16 row is
// then one round trip), and the weights bypass L1 (ld_stream) so the activation vector stays
// there.
// gemv_glu (a decode step's gate/up projection and SwiGLU in one pass): B has 2p rows, gate
// rows first. Warps pair up: the first of a pair is gemv_t on gate row j, the second on up row
// p + j (the same loads and sums as gemv_t, so twice its warps and the same bytes in flight);
// the second hands its sum over in shared memory and the first writes silu(g) * u, each
// product rounded to T first (projection_out), as matmul then swiglu would.
// NORM (gemv_t_norm, gemv_glu_norm: the decode step's RMSNorm folded into the projection whose
// columns carry the norm's scale): each lane also sums a[k]^2 over the values it already
// loads, so every warp gets the same sum (same lanes, same order) with no pass of its own;
// the dot product is scaled by r = 1 / sqrt(mean(a^2) + eps) at the end: r * (B a), the
// normed vector never rounded. gemv_t_add: out[j] += the rounded product (the residual stream).
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 8
#endif

struct GemvParams { i64 n, p; float eps; };  // cuda/gemv.py GEMV_PARAMS

template <class T, bool NORM>
__device__ __forceinline__ void gemv_row(const T* __restrict__ a, const T* __restrict__ row,
                                         i64 K, typename Acc<T>::type& sum,
                                         typename Acc<T>::type& squares) {
  typedef typename Acc<T>::type Cmp;
  constexpr int V = 16 / sizeof(T), U = GEMV_UNROLL;
  Cmp acc = Cmp(0), sq = Cmp(0);
  i64 k = 0;
  if (aligned16(row) && aligned16(a)) {
    const i64 nv = K / V;
    const Vec<T, V>* rv = reinterpret_cast<const Vec<T, V>*>(row);
    const Vec<T, V>* av = reinterpret_cast<const Vec<T, V>*>(a);
    for (i64 base = threadIdx.x; base < nv; base += 32 * U) {
      Vec<T, V> x[U], y[U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const i64 q = base + u * 32;
        if (q < nv) {
          x[u] = ld_stream<T, V>(rv + q);
          y[u] = av[q];
        }
      }
#pragma unroll
      for (int u = 0; u < U; u++) {
        if (base + u * 32 < nv) {
#pragma unroll
          for (int e = 0; e < V; e++) {
            const Cmp yv = load(y[u].v[e]);
            acc += load(x[u].v[e]) * yv;
            if (NORM) sq += yv * yv;
          }
        }
      }
    }
    k = nv * V;
  }
  for (k += threadIdx.x; k < K; k += 32) {
    const Cmp yv = load(a[k]);
    acc += load(row[k]) * yv;
    if (NORM) sq += yv * yv;
  }
  sum = warp_sum(acc);
  if (NORM) squares = warp_sum(sq);
}

// r = 1 / sqrt(mean(a^2) + eps) from a warp's sum of squares (nn.cu's rmsnorm formula)
template <class C> __device__ __forceinline__ C rms_factor(C squares, i64 K, float eps) {
  return C(1) / m_sqrt(squares / (C)K + (C)eps);
}

// KIND 0: out[j] = (B a)[j]; 1 (NORM): r * (B a)[j]; 2 (add): out[j] + (B a)[j] rounded first
template <class T, int KIND>
__device__ __forceinline__ void gemv_t(const T* __restrict__ a, const T* __restrict__ B,
                                       T* __restrict__ out, i64 n, i64 p, float eps) {
  typedef typename Acc<T>::type Cmp;
  const i64 j = (i64)blockIdx.x * blockDim.y + threadIdx.y;
  if (j >= p) return;
  Cmp acc, squares = Cmp(0);
  gemv_row<T, KIND == 1>(a, B + j * n, n, acc, squares);
  if (threadIdx.x != 0) return;
  if (KIND == 1) acc *= rms_factor(squares, n, eps);
  out[j] = KIND == 2 ? projection_out<T, 2>((float)acc, 0.f, load(out[j])) : store<T>(acc);
}

// blockDim.y even: warps (2i, 2i + 1) of a group compute output blockIdx.x * blockDim.y / 2 + i
template <class T, bool NORM>
__device__ __forceinline__ void gemv_glu(const T* __restrict__ a, const T* __restrict__ B,
                                         T* __restrict__ out, i64 n, i64 p, float eps,
                                         float* handed) {
  typedef typename Acc<T>::type Cmp;
  const i64 j = (i64)blockIdx.x * (blockDim.y / 2) + threadIdx.y / 2;
  const bool up = threadIdx.y & 1, live = j < p;
  Cmp acc = Cmp(0), squares = Cmp(0);
  if (live) gemv_row<T, NORM>(a, B + (j + (up ? p : 0)) * n, n, acc, squares);
  if (NORM) acc *= rms_factor(squares, n, eps);  // the same factor in both warps of a pair
  if (up && threadIdx.x == 0) handed[threadIdx.y / 2] = (float)acc;
  __syncthreads();
  if (live && !up && threadIdx.x == 0)
    out[j] = projection_out<T, 1>((float)acc, handed[threadIdx.y / 2], Cmp(0));
}

// part[s][j] = sum over this split's k of a[k] * B[k][j]: B stored (n, p); lanes over
// 16-byte column groups, warps over k, shared memory to sum the warps.
template <class T>
__device__ __forceinline__ void gemv_n(const T* __restrict__ a, const T* __restrict__ B,
                                       float* __restrict__ part, const MatmulParams& p,
                                       float* smem) {
  constexpr int V = 16 / sizeof(T);
  const i64 N = p.p, K = p.n;
  const bool vec = aligned16(B) && N % V == 0;
  const i64 j0 = ((i64)blockIdx.x * 32 + threadIdx.x) * V;
  const i64 k_begin = (i64)blockIdx.y * p.chunk;
  const i64 k_end = k_begin + p.chunk < K ? k_begin + p.chunk : K;
  float acc[V];
#pragma unroll
  for (int e = 0; e < V; e++) acc[e] = 0.f;
  if (j0 < N) {
    for (i64 k = k_begin + threadIdx.y; k < k_end; k += blockDim.y) {
      const float ak = (float)load(a[k]);
      if (vec) {
        const Vec<T, V> x = *reinterpret_cast<const Vec<T, V>*>(B + k * N + j0);
#pragma unroll
        for (int e = 0; e < V; e++) acc[e] += ak * (float)load(x.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < V; e++)
          if (j0 + e < N) acc[e] += ak * (float)load(B[k * N + j0 + e]);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < V; e++) smem[(threadIdx.y * 32 + threadIdx.x) * V + e] = acc[e];
  __syncthreads();
  if (threadIdx.y == 0 && j0 < N) {
    for (int y = 1; y < (int)blockDim.y; y++)
#pragma unroll
      for (int e = 0; e < V; e++) acc[e] += smem[(y * 32 + threadIdx.x) * V + e];
#pragma unroll
    for (int e = 0; e < V; e++)
      if (j0 + e < N) part[blockIdx.y * N + j0 + e] = acc[e];
  }
}

// out[z] = A[z] @ B[z] for m <= 8 rows, A (m, n) and B (n, p) row-major (the decode step's
// probs @ V, n the cache length): bandwidth-bound, B read once. A group of 256 threads owns
// 8 column groups of 16 bytes (lane % 8) and k slice [split*chunk, +chunk) of matrix z
// (blockIdx.y = split, blockIdx.z = z); its 32 rows of threads (tid / 8) take every 32nd k,
// 8 loads in flight each. The 32 partial sums of each output are added by shuffles within a
// warp (lanes l, l^8, l^16, l^24), then across the 8 warps in shared memory. With splits > 1
// the group writes float32 partials to part[(split*batch + z)*m*p + row*p + col] and
// gemv_combine adds the slices (its p = batch*m*p); with one split it writes out.
constexpr int SKINNY_M = 8, SKINNY_CG = 8, SKINNY_THREADS = 256, SKINNY_U = 8;
template <class T>
__device__ __forceinline__ void skinny(const T* __restrict__ A, const T* __restrict__ B,
                                       T* __restrict__ out, float* __restrict__ part,
                                       const MatmulParams& p, float* red) {
  constexpr int V = 16 / sizeof(T), KL = SKINNY_THREADS / SKINNY_CG, MV = SKINNY_M * V;
  const i64 M = p.m, K = p.n, N = p.p, groups = N / V;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const i64 cg = (i64)blockIdx.x * SKINNY_CG + (tid % SKINNY_CG);
  const i64 split = blockIdx.y, z = blockIdx.z;
  const bool live = cg < groups;
  const T* a = A + z * p.stride_a;
  const T* b = B + z * p.stride_b + (live ? cg : 0) * V;
  const i64 k0 = split * p.chunk, k1 = k0 + p.chunk < K ? k0 + p.chunk : K;
  float acc[SKINNY_M][V];
#pragma unroll
  for (int r = 0; r < SKINNY_M; r++)
#pragma unroll
    for (int e = 0; e < V; e++) acc[r][e] = 0.f;
  if (live) {
    for (i64 kb = k0 + tid / SKINNY_CG; kb < k1; kb += KL * SKINNY_U) {
      Vec<T, V> x[SKINNY_U];
#pragma unroll
      for (int u = 0; u < SKINNY_U; u++)
        if (kb + u * KL < k1) x[u] = *reinterpret_cast<const Vec<T, V>*>(b + (kb + u * KL) * N);
#pragma unroll
      for (int u = 0; u < SKINNY_U; u++) {
        const i64 k = kb + u * KL;
        if (k >= k1) continue;
#pragma unroll
        for (int r = 0; r < SKINNY_M; r++) {
          if (r >= M) continue;
          const float ar = (float)load(a[r * K + k]);
#pragma unroll
          for (int e = 0; e < V; e++) acc[r][e] += ar * (float)load(x[u].v[e]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < SKINNY_M; r++)
#pragma unroll
    for (int e = 0; e < V; e++) {
      float v = acc[r][e];
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      acc[r][e] = v;
    }
  // red[warp][column group][row * V + e]
  if (lane < SKINNY_CG) {
#pragma unroll
    for (int r = 0; r < SKINNY_M; r++)
#pragma unroll
      for (int e = 0; e < V; e++) red[(warp * SKINNY_CG + lane) * MV + r * V + e] = acc[r][e];
  }
  __syncthreads();
  for (int i = tid; i < SKINNY_CG * MV; i += SKINNY_THREADS) {
    const int c = i / MV, r = (i % MV) / V, e = i % V;
    const i64 col_group = (i64)blockIdx.x * SKINNY_CG + c;
    if (r >= M || col_group >= groups) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < SKINNY_THREADS / 32; w++) v += red[(w * SKINNY_CG + c) * MV + r * V + e];
    const i64 col = col_group * V + e;
    if (p.splits == 1) {
      out[(z * M + r) * N + col] = store<T>((typename Acc<T>::type)v);
    } else {
      part[((split * p.batch + z) * M + r) * N + col] = v;
    }
  }
}

// out[j] = sum over the splits of part[q * p + j]: 8 independent loads in flight per thread
template <class T>
__device__ __forceinline__ void gemv_combine(const float* __restrict__ part, T* __restrict__ out,
                                             const MatmulParams& p) {
  const i64 t0 = global_thread(), step = grid_threads();
  for (i64 j = t0; j < p.p; j += step) {
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    i64 q = 0;
    for (; q + 8 <= p.splits; q += 8) {
#pragma unroll
      for (int u = 0; u < 8; u++) s[u] += part[(q + u) * p.p + j];
    }
    for (; q < p.splits; q++) s[0] += part[q * p.p + j];
    out[j] = store<T>((typename Acc<T>::type)(((s[0] + s[1]) + (s[2] + s[3])) +
                                              ((s[4] + s[5]) + (s[6] + s[7]))));
  }
}

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
