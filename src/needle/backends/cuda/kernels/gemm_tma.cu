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
// One group of 384 threads computes a 128 x 256 tile of C, walking k in steps of 64:
//  * warpgroup 0 is the producer: one thread waits until a stage is empty, arms the
//    stage's "full" mbarrier with the stage's byte count, and issues two TMA box loads
//    (A: 64 x 128, B: 64 x 256; 128-byte swizzle) that complete on that mbarrier;
//  * warpgroups 1 and 2 are consumers, each owning 64 rows x 256 columns of the tile
//    (wgmma m64n256k16, 128 fp32 accumulators per thread). A consumer waits on full[s],
//    issues the stage's 4 wgmmas, and keeps that batch in flight while it waits for the
//    previous batch (wgmma.wait_group 1); once that one has completed, its stage is
//    released (one arrive per consumer warp on empty[s]).
// Stage s of k-tile kt is s = kt % STAGES, and both barriers of a stage complete one phase
// per use, so the parity to wait for is (kt / STAGES) & 1 on full[s] (consumers) and the
// opposite one on empty[s] (producer: a fresh barrier counts as having completed the phase
// before its first, so the first STAGES waits return at once).
//
// Shared memory (dynamic, base rounded up to 1024 bytes): STAGES x [A 16 KiB | B 32 KiB],
// then full[STAGES] and empty[STAGES] (8 bytes each). With 4 stages: 197,696 bytes.
#include "common.cuh"
#include "tensor_core.cuh"

#ifndef GEMM_TMA_STAGES
#define GEMM_TMA_STAGES 4
#endif
#ifndef GEMM_TMA_GROUP_M  // tiles walk M first in groups of this many tile rows (L2 reuse)
#define GEMM_TMA_GROUP_M 8
#endif

// The host's params struct (gpu.py _MATMUL), laid out as matmul.cu's MatmulParams.
struct GemmParams { i64 m, n, p, batch, stride_a, stride_b, trans_a, trans_b, splits, chunk; };

// A CUtensorMap: 128 opaque bytes, 64-byte aligned (NVRTC has no cuda.h).
struct alignas(64) TmaMap { u64 words[16]; };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace tma {
constexpr int BM = 128, BN = 256, BK = 64, STAGES = GEMM_TMA_STAGES;
constexpr u32 A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr u32 CONSUMER_WARPS = 8;  // arrivals that empty a stage

using tc::smem_u32;

// ---- mbarriers ---------------------------------------------------------------------------
__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// true once the phase of parity `parity` has completed
__device__ __forceinline__ bool bar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
  while (!bar_try_wait(bar, parity)) {
  }
}

// ---- TMA ---------------------------------------------------------------------------------
__device__ __forceinline__ void tma_load(u32 dst, const TmaMap* map, u32 bar, int k, int row,
                                         int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(k), "r"(row), "r"(z), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// ---- wgmma -------------------------------------------------------------------------------
// descriptors, fence, commit and wait: wg:: in tensor_core.cuh
// Pin the accumulators around an MMA batch so the compiler moves none of them while a wgmma
// may still write them (otherwise ptxas serializes the wgmmas, warning C7514).
__device__ __forceinline__ void fence_acc(float (&d)[128]) {
#pragma unroll
  for (int q = 0; q < 128; q++) asm volatile("" : "+f"(d[q])::"memory");
}

#define TMA_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define TMA_MMA256(TYPE, TB)                                                                       \
  asm volatile(                                                                                \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                           \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " "                        \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "              \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "     \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "     \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "     \
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "     \
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "     \
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, "     \
      "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
      "%124, %125, %126, %127}, "                                                              \
      "%128, %129, p, 1, 1, 0, " TB ";\n"                                                       \
      "}\n"                                                                                    \
      : TMA_ACC8(0), TMA_ACC8(8), TMA_ACC8(16), TMA_ACC8(24), TMA_ACC8(32), TMA_ACC8(40),      \
        TMA_ACC8(48), TMA_ACC8(56), TMA_ACC8(64), TMA_ACC8(72), TMA_ACC8(80), TMA_ACC8(88),    \
        TMA_ACC8(96), TMA_ACC8(104), TMA_ACC8(112), TMA_ACC8(120)                              \
      : "l"(da), "l"(db), "r"(1))
// BN_MAJOR: B's tile is N-major (imm-trans-b = 1)
template <class T, bool BN_MAJOR> struct Mma256;
template <> struct Mma256<bf16_t, false> {
  __device__ static void run(float (&d)[128], u64 da, u64 db) { TMA_MMA256("bf16", "0"); }
};
template <> struct Mma256<half_t, false> {
  __device__ static void run(float (&d)[128], u64 da, u64 db) { TMA_MMA256("f16", "0"); }
};
template <> struct Mma256<bf16_t, true> {
  __device__ static void run(float (&d)[128], u64 da, u64 db) { TMA_MMA256("bf16", "1"); }
};
template <> struct Mma256<half_t, true> {
  __device__ static void run(float (&d)[128], u64 da, u64 db) { TMA_MMA256("f16", "1"); }
};

// Descriptor of an N-major B tile: BK k-rows of 4 boxes, each box 64 k-rows x 128 bytes
// (64 columns) with the 128-byte swizzle; 8 k-rows (1 KiB) per swizzle atom. Stepping k by
// 16 rows adds 2 KiB to the start address (a multiple of the 1 KiB atom: base offset 0).
__device__ __forceinline__ u64 desc_mn(u32 smem_addr) {
  u64 d = (u64)((smem_addr & 0x3FFFF) >> 4);
  d |= (u64)((BK * 128) >> 4) << 16;  // leading byte offset: the next 64 columns (next box)
  d |= (u64)(1024 >> 4) << 32;        // stride byte offset: the next 8 k-rows
  d |= (u64)1 << 62;                  // 128-byte swizzle
  return d;
}

// Tile (tm, tn) of linear tile id t over tiles_m x tiles_n tiles: groups of GROUP_M tile rows,
// walked down M first within a group, so the groups running at once share B tiles in L2.
__device__ __forceinline__ void tile_of(int t, int tiles_m, int tiles_n, int& tm, int& tn) {
  const int per_group = GEMM_TMA_GROUP_M * tiles_n;
  const int first_m = (t / per_group) * GEMM_TMA_GROUP_M;
  const int rows = min(tiles_m - first_m, GEMM_TMA_GROUP_M);
  const int r = t % per_group;
  tm = first_m + r % rows;
  tn = r / rows;
}

template <class T, bool BN_MAJOR>
__device__ __forceinline__ void run(T* __restrict__ C, const GemmParams& p, const TmaMap* map_a,
                                    const TmaMap* map_b, unsigned char* smem) {
  const u32 base = (smem_u32(smem) + 1023u) & ~1023u;
  const u32 full0 = base + STAGES * STAGE_BYTES, empty0 = full0 + STAGES * 8;
  const int tid = threadIdx.x, wg = tid / 128;
  const int tiles_m = (int)((p.m + BM - 1) / BM), tiles_n = (int)((p.p + BN - 1) / BN);
  int tm, tn;
  tile_of((int)blockIdx.x, tiles_m, tiles_n, tm, tn);
  const int m0 = tm * BM, n0 = tn * BN, z = (int)blockIdx.z;
  const int KT = (int)((p.n + BK - 1) / BK);

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; s++) {
      bar_init(full0 + 8 * s, 1);  // the producer's arrive.expect_tx (+ the TMA bytes)
      bar_init(empty0 + 8 * s, CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------------ producer ------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == 0) {
      tma_prefetch(map_a);
      tma_prefetch(map_b);
      for (int kt = 0; kt < KT; kt++) {
        const int s = kt % STAGES;
        const u32 parity = (u32)(kt / STAGES) & 1u;
        bar_wait(empty0 + 8 * s, parity ^ 1u);
        const u32 full = full0 + 8 * s, sa = base + s * STAGE_BYTES;
        bar_expect_tx(full, STAGE_BYTES);  // a box counts whole, zero-filled parts included
        tma_load(sa, map_a, full, kt * BK, m0, z);
        if (BN_MAJOR) {  // B (n x p): four boxes of 64 columns x 64 k-rows
#pragma unroll
          for (int j = 0; j < BN / 64; j++)
            tma_load(sa + A_BYTES + j * (BK * 128), map_b, full, n0 + 64 * j, kt * BK, z);
        } else {
          tma_load(sa + A_BYTES, map_b, full, kt * BK, n0, z);
        }
      }
    }
  } else {
    // ------------------------------------------------------------------ consumers -----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int g = wg - 1, lane = tid % 32, w = (tid % 128) / 32;
    float acc[128];
#pragma unroll
    for (int q = 0; q < 128; q++) acc[q] = 0.f;

    for (int kt = 0; kt < KT; kt++) {
      const int s = kt % STAGES;
      bar_wait(full0 + 8 * s, (u32)(kt / STAGES) & 1u);
      const u32 sa = base + s * STAGE_BYTES + g * 64 * 128, sb = base + s * STAGE_BYTES + A_BYTES;
      fence_acc(acc);
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; kk++)
        Mma256<T, BN_MAJOR>::run(acc, wg::desc(sa + kk * 32),
                                 BN_MAJOR ? desc_mn(sb + kk * 16 * 128) : wg::desc(sb + kk * 32));
      wg::commit();
      wg::wait<1>();  // the previous k-tile's batch has completed: its stage may be refilled
      fence_acc(acc);
      if (kt > 0 && lane == 0) bar_arrive(empty0 + 8 * ((kt - 1) % STAGES));
    }
    wg::wait<0>();
    fence_acc(acc);

    // accumulator layout: warp w of the warpgroup holds rows 16w..16w+15; per n8 chunk i,
    // lane l holds (row l/4, cols 8i + 2(l%4), +1) in acc[4i], acc[4i+1] and row + 8 in
    // acc[4i+2], acc[4i+3]. p is a multiple of 8, so a pair is in bounds when its first is.
    const i64 M = p.m, N = p.p;
    T* Cz = C + (i64)z * M * N;
    const i64 row0 = (i64)m0 + g * 64 + w * 16 + lane / 4;
#pragma unroll
    for (int i = 0; i < 32; i++) {
      const i64 col = (i64)n0 + i * 8 + (lane % 4) * 2;
      if (col >= N) continue;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const i64 row = row0 + h * 8;
        if (row >= M) continue;
        const u32 lo = store<T>(acc[4 * i + 2 * h]).bits, hi = store<T>(acc[4 * i + 2 * h + 1]).bits;
        *reinterpret_cast<u32*>(Cz + row * N + col) = lo | (hi << 16);
      }
    }
  }
}
}  // namespace tma
#define GEMM_TMA_BODY(T, BN_MAJOR)                                                             \
  extern __shared__ __align__(1024) unsigned char smem[];                                      \
  tma::run<T, BN_MAJOR>(out, p, &map_a, &map_b, smem);
#else
// other targets: the names exist (every .cu compiles for sm_80 and sm_90 in CI); the host
// launches these only on sm_90a builds (device feature "tma")
#define GEMM_TMA_BODY(T, BN_MAJOR) __trap();
#endif

// a and b are not read (the tensor maps address them); they are arguments so that graph
// capture keeps their buffers alive, like every other kernel's operands.
#define GEMM_TMA(NAME, T, BN_MAJOR)                                                            \
  extern "C" __global__ void __launch_bounds__(384, 1)                                         \
      NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,              \
           GemmParams p, const __grid_constant__ TmaMap map_a,                                 \
           const __grid_constant__ TmaMap map_b) {                                             \
    pdl_entry();                                                                               \
    GEMM_TMA_BODY(T, BN_MAJOR)                                                                 \
  }
// shared bytes: GEMM_TMA_STAGES * (128 + 256) * 64 * 2 + 16 * GEMM_TMA_STAGES + 1024
ONLY(bf16, GEMM_TMA(matmul_tma_bf16, bf16_t, false))
ONLY(f16, GEMM_TMA(matmul_tma_f16, half_t, false))
ONLY(bf16, GEMM_TMA(matmul_tma_nn_bf16, bf16_t, true))
ONLY(f16, GEMM_TMA(matmul_tma_nn_f16, half_t, true))
