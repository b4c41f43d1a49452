// Hopper GEMM with TMA loads and warp specialization (docs/cuda_notes.md, "TMA GEMM (v5)").
//
//  * matmul_tma_{bf16,f16}: C[z] (m x p, row-major) = A[z] (m x n, row-major) times B[z]^T,
//    B given as (p x n) row-major: both operands K-major (a Linear layer's layout).
//  * matmul_tma_nn_{bf16,f16}: the same with B given as (n x p) row-major (A @ B as written):
//    B is N-major ("MN-major" in the PTX ISA), read untransposed. Its tiles arrive as four
//    64-column boxes (64 x 64, 8 KiB each, side by side); the descriptor steps 8 KiB between
//    them (leading byte offset) and 1 KiB between groups of 8 k-rows (stride byte offset),
//    and the wgmma takes B transposed (imm-trans-b = 1). No transposed copy of B is made.
//    fp32 accumulation, output rounded once to the input dtype. z = blockIdx.z (batch);
//    C[z] starts at z*m*p; A[z] and B[z] are addressed by the two tensor maps (3-d: k, row,
//    batch), which carry the batch strides and zero-fill everything out of bounds, so m, n
//    and p need not be multiples of the tile (n and p multiples of 8: the host checks).
//
// One group of 384 threads computes a 128 x W tile of C (W = 256, 128 or 64: kernels
// matmul_tma, matmul_tma128, matmul_tma64; the host picks W so that the tiles' waves over
// the SMs finish first), walking k in steps of 64:
//  * warpgroup 0 is the producer: one thread waits until a stage is empty, arms the
//    stage's "full" mbarrier with the stage's byte count, and issues the TMA box loads
//    (A: 64 x 128, B: 64 x W; 128-byte swizzle) that complete on that mbarrier;
//  * warpgroups 1 and 2 are consumers, each owning 64 rows x W columns of the tile
//    (wgmma m64nWk16, W / 2 fp32 accumulators per thread). A consumer waits on full[s],
//    issues the stage's 4 wgmmas, and keeps that batch in flight while it waits for the
//    previous batch (wgmma.wait_group 1); once that one has completed, its stage is
//    released (one arrive per consumer warp on empty[s]).
// Stage s of k-tile kt is s = kt % STAGES, and both barriers of a stage complete one phase
// per use, so the parity to wait for is (kt / STAGES) & 1 on full[s] (consumers) and the
// opposite one on empty[s] (producer: a fresh barrier counts as having completed the phase
// before its first, so the first STAGES waits return at once).
//
// Shared memory (dynamic, base rounded up to 1024 bytes): STAGES x [A 16 KiB | B W/8 KiB],
// then full[STAGES] and empty[STAGES] (8 bytes each): 197,696 bytes with 4 stages of W = 256
// (6 of 128 and 8 of 64: 32 and 64 bytes more barriers).
#include "gemm_tma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GEMM_TMA_BODY(T, BN, BN_MAJOR, GLU)                                                    \
  extern __shared__ __align__(1024) unsigned char smem[];                                      \
  tma::run<T, BN, BN_MAJOR, GLU>(out, p, &map_a, &map_b, smem);
#else
// other targets: the names exist (every .cu compiles for sm_80 and sm_90 in CI); the host
// launches these only on sm_90a builds (device feature "tma")
#define GEMM_TMA_BODY(T, BN, BN_MAJOR, GLU) __trap();
#endif

// a and b are not read (the tensor maps address them); they are arguments so that graph
// capture keeps their buffers alive, like every other kernel's operands.
#define GEMM_TMA_GLU(NAME, T, BN, BN_MAJOR, GLU)                                               \
  extern "C" __global__ void __launch_bounds__(384, 1)                                         \
      NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,              \
           GemmParams p, const __grid_constant__ TmaMap map_a,                                 \
           const __grid_constant__ TmaMap map_b) {                                             \
    pdl_entry();                                                                               \
    GEMM_TMA_BODY(T, BN, BN_MAJOR, GLU)                                                        \
  }
#define GEMM_TMA(NAME, T, BN, BN_MAJOR) GEMM_TMA_GLU(NAME, T, BN, BN_MAJOR, false)
// Names: matmul_tma[W][_nn|_glu|_tf32]_{bf16,f16,f32}, W the tile width when not 256 (host:
// _tma_plan).
// shared bytes: S * (128 + W) * 64 * 2 + 16 * S + 1024, S = stages<W>()
#define GEMM_TMA_WIDTHS(SFX, T)                                                                \
  GEMM_TMA(matmul_tma_##SFX, T, 256, false) GEMM_TMA(matmul_tma_nn_##SFX, T, 256, true)        \
  GEMM_TMA(matmul_tma128_##SFX, T, 128, false) GEMM_TMA(matmul_tma128_nn_##SFX, T, 128, true)  \
  GEMM_TMA(matmul_tma64_##SFX, T, 64, false) GEMM_TMA(matmul_tma64_nn_##SFX, T, 64, true)
ONLY(bf16, GEMM_TMA_WIDTHS(bf16, bf16_t))
ONLY(f16, GEMM_TMA_WIDTHS(f16, half_t))
// A @ W^T with W a fused gate/up weight (2p, n), then swiglu: (m, p) outputs (matmul_swiglu)
ONLY(bf16, GEMM_TMA_GLU(matmul_tma_glu_bf16, bf16_t, 256, false, true))
ONLY(f16, GEMM_TMA_GLU(matmul_tma_glu_f16, half_t, 256, false, true))
// float32 as TF32 (ndl.set_float32_matmul_precision("high")): K-major B only
ONLY(f32, GEMM_TMA(matmul_tma_tf32_f32, float, 256, false)
          GEMM_TMA(matmul_tma128_tf32_f32, float, 128, false)
          GEMM_TMA(matmul_tma64_tf32_f32, float, 64, false))
