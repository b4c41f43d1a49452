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
// One group of 384 threads computes 128 x W tiles of C (W = 256, 176, 160, 128, 80 or 64:
// kernels matmul_tma, matmul_tma176, ...; 176, 160 and 80 with K-major B only, their last
// 48, 32 or 16 columns stored by the threads; the host picks W so that the tiles' waves over
// the SMs finish first), walking k in steps of 64. The grid is persistent (at most one
// group per SM): each group walks its share of the tiles (run(), below).
//  * warpgroup 0 is the producer: one thread waits until a stage is empty, arms the
//    stage's "full" mbarrier with the stage's byte count, and issues the TMA box loads
//    (A: 64 x 128, B: 64 x W; 128-byte swizzle) that complete on that mbarrier;
//  * warpgroups 1 and 2 are consumers, each owning 64 rows x W columns of the tile
//    (wgmma m64nWk16, W / 2 fp32 accumulators per thread), and writing them out through
//    its own staging buffers and TMA stores while the producer loads the next tile.
// Both barriers of a stage complete one phase per use, so for the group's it-th k-tile
// (counted over all its tiles), in stage it % STAGES, the parity to wait for is
// (it / STAGES) & 1 on full[s] (consumers) and the opposite one on empty[s] (producer: a
// fresh barrier counts as having completed the phase before its first, so the first STAGES
// waits return at once).
//
// Shared memory (dynamic, base rounded up to 1024 bytes): STAGES x [A 16 KiB | B W/8 KiB],
// four 8 KiB staging buffers (two a consumer warpgroup), then full[STAGES] and
// empty[STAGES] (8 bytes each) and ids[STAGES] (4 bytes): 230,480 bytes with 4 stages of
// W = 256 (8 of 64: 80 bytes more; the other widths less, stages<BN>()). C is written by TMA
// stores through a third tensor map (box 64 rows x 128 bytes), which also clips the tiles at
// C's edges; where C cannot have one (rows not 16-byte multiples), thread by thread
// (store_values).
#include "common.cuh"
#include "mbarrier.cuh"
#include "tensor_core.cuh"

// Pipeline stages a tile width (tuning.py TMA_STAGES: the same numbers, test_tuning.py checks),
// measured: the 160-, 128- and 80-wide tiles ran 4-13% faster with 4, 4 and 6 stages than
// with the 5, 6 and 7 that fill shared memory (docs/cuda_notes.md v34); 256, 176 and 64 are
// fastest full. -DGEMM_TMA_STAGES=S gives every width what S stages of the 128 x 256 tile
// take in shared memory; -DGEMM_TMA_STAGES_<W>=s sets one width.
#ifdef GEMM_TMA_STAGES
#define GEMM_TMA_FIT(W) (GEMM_TMA_STAGES * (128 + 256) / (128 + W))
#else
#define GEMM_TMA_FIT(W) GEMM_TMA_DEFAULT_##W
#endif
#define GEMM_TMA_DEFAULT_256 4
#define GEMM_TMA_DEFAULT_176 5
#define GEMM_TMA_DEFAULT_160 4
#define GEMM_TMA_DEFAULT_128 4
#define GEMM_TMA_DEFAULT_80 6
#define GEMM_TMA_DEFAULT_64 8
#ifndef GEMM_TMA_STAGES_256
#define GEMM_TMA_STAGES_256 GEMM_TMA_FIT(256)
#endif
#ifndef GEMM_TMA_STAGES_176
#define GEMM_TMA_STAGES_176 GEMM_TMA_FIT(176)
#endif
#ifndef GEMM_TMA_STAGES_160
#define GEMM_TMA_STAGES_160 GEMM_TMA_FIT(160)
#endif
#ifndef GEMM_TMA_STAGES_128
#define GEMM_TMA_STAGES_128 GEMM_TMA_FIT(128)
#endif
#ifndef GEMM_TMA_STAGES_80
#define GEMM_TMA_STAGES_80 GEMM_TMA_FIT(80)
#endif
#ifndef GEMM_TMA_STAGES_64
#define GEMM_TMA_STAGES_64 GEMM_TMA_FIT(64)
#endif
#ifndef GEMM_TMA_GROUP_M  // tiles walk M first in groups of this many tile rows (L2 reuse)
#define GEMM_TMA_GROUP_M 8
#endif

// The host's params struct (gpu.py _MATMUL), laid out as matmul.cu's MatmulParams.
struct GemmParams { i64 m, n, p, batch, stride_a, stride_b, trans_a, trans_b, splits, chunk; };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace tma {
constexpr int BM = 128, BK = 64;  // BK: k per stage of a 2-byte type (128-byte rows)
constexpr u32 A_BYTES = BM * 128;
// k per stage: one 128-byte row (the swizzle's width) of each operand's tile
template <class T> __device__ constexpr int k_tile() { return 128 / (int)sizeof(T); }
constexpr u32 CONSUMER_WARPS = 8;  // arrivals that empty a stage
// Stages of a BN-wide tile (GEMM_TMA_STAGES_<BN>, above); the host sizes shared memory alike.
template <int BN> __device__ constexpr int stages() {
  return BN == 256 ? GEMM_TMA_STAGES_256 : BN == 176 ? GEMM_TMA_STAGES_176
       : BN == 160 ? GEMM_TMA_STAGES_160 : BN == 128 ? GEMM_TMA_STAGES_128
       : BN == 80  ? GEMM_TMA_STAGES_80  : GEMM_TMA_STAGES_64;
}

using tc::smem_u32;

// ---- wgmma: wg::Mma, wg::fence_acc and descriptors in tensor_core.cuh ------------------

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

__device__ __forceinline__ void st_shared_i32(u32 at, int v) {
  asm volatile("st.shared.s32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_shared_i32(u32 at) {
  int v;
  asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(at) : "memory");
  return v;
}

// ---- epilogue ----------------------------------------------------------------------------
// bar.sync among COUNT threads (ids above 0, which __syncthreads uses)
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// A consumer warpgroup's tile leaves through shared memory, 64 rows x 128 bytes at a time
// (a chunk: 64 halves or 32 floats a row), each chunk stored to C by one TMA store. The
// chunks alternate between the warpgroup's two 8 KiB buffers, apart from the pipeline's
// stages (which the producer is already filling with the next tile's operands), so one
// chunk's store runs while the next is staged. A chunk is laid out as TMA's 128-byte
// swizzle has it (16-byte piece c of row r at c ^ (r % 8)): the 8 rows of a fragment store
// fall in different banks.
constexpr u32 EPI_BYTES = 64 * 128;

__device__ __forceinline__ u32 swizzled(u32 buf, int row, int byte) {
  return buf + row * 128 + ((((u32)byte >> 4) ^ ((u32)row & 7u)) << 4) + ((u32)byte & 15u);
}
// four 8 x 8 matrices of 16-bit values, one row address a lane (lanes 8j..8j+7: matrix j)
__device__ __forceinline__ void stmatrix_x4(u32 at, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(at), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// the 64 x 128-byte box at `src` to C at (col, row) of matrix z; one bulk group
__device__ __forceinline__ void tma_store(const TmaMap* map, u32 src, int col, int row, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
      "cp.async.bulk.commit_group;\n"
      ::"l"(reinterpret_cast<u64>(map)), "r"(col), "r"(row), "r"(z), "r"(src) : "memory");
}
// until at most N of this thread's bulk groups are still reading shared memory
template <int N> __device__ __forceinline__ void tma_store_read_wait() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// until all of this thread's bulk groups have completed (their writes done)
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// this thread's shared-memory writes, visible to the TMA (async proxy) that reads them
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Accumulator layout: warp w of a warpgroup holds rows 16w..16w+15 of its 64; per n8 chunk
// i, lane l holds (row l/4, cols 8i + 2(l%4), +1) in acc[4i], acc[4i+1] and row + 8 in
// acc[4i+2], acc[4i+3]: for 16-bit outputs, the fragments of two 8 x 8 matrices, so one
// stmatrix.x4 stages two n8 chunks (rows 0-7 and 8-15 of each).
template <class T, int BN, int C0>
__device__ __forceinline__ void stage_chunk(const float (&acc)[BN / 2], u32 buf, int w, int lane) {
  constexpr int END = (C0 + 64 < BN ? C0 + 64 : BN) / 8;  // 80 / 160 / 176: the last 16 / 32 / 48
#pragma unroll
  for (int i = C0 / 8; i < END; i += 2) {
    const int j = lane / 8, row = w * 16 + (j & 1) * 8 + lane % 8;
    stmatrix_x4(swizzled(buf, row, (i - C0 / 8 + j / 2) * 16),
                tc::pack2<T>(acc[4 * i], acc[4 * i + 1]), tc::pack2<T>(acc[4 * i + 2], acc[4 * i + 3]),
                tc::pack2<T>(acc[4 * i + 4], acc[4 * i + 5]),
                tc::pack2<T>(acc[4 * i + 6], acc[4 * i + 7]));
  }
}
// float outputs (TF32 products): a thread's two values of a row a store
template <class T, int BN, int C0>
__device__ __forceinline__ void stage_chunk_f32(const float (&acc)[BN / 2], u32 buf, int w,
                                                int lane) {
#pragma unroll
  for (int i = C0 / 8; i < (C0 + 32) / 8; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const u32 at = swizzled(buf, w * 16 + lane / 4 + 8 * h, (i * 8 - C0 + (lane % 4) * 2) * 4);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                   ::"r"(at), "f"(acc[4 * i + 2 * h]), "f"(acc[4 * i + 2 * h + 1]) : "memory");
    }
}

// one value of a staged chunk
template <class T> __device__ __forceinline__ T ld_value(u32 at) {
  T v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v.bits) : "r"(at));
  return v;
}
template <> __device__ __forceinline__ float ld_value<float>(u32 at) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(at));
  return v;
}

// Where C's rows are not 16-byte multiples, or C does not start 16-byte aligned, TMA
// cannot store it (the host passes p.chunk = 1 and no map): the warpgroup's 128 threads
// write a staged chunk's values one by one, rows (row0 + r) and columns (col0 + c) inside
// the m x p matrix only, and before column `end` (an 80-, 160- or 176-wide tile's last chunk:
// its 16, 32 or 48 columns, where a TMA box of 64 would write into the next tile's).
template <class T>
__device__ __forceinline__ void store_values(T* __restrict__ C, u32 buf, i64 M, i64 N, int col0,
                                             int row0, int t, i64 end) {
  constexpr int CW = 128 / (int)sizeof(T);
  for (int c = t; c < 64 * CW; c += 128) {
    const int r = c / CW, col = c % CW;
    const i64 row = (i64)row0 + r, gcol = (i64)col0 + col;
    if (row < M && gcol < end) C[row * N + gcol] = ld_value<T>(swizzled(buf, r, col * (int)sizeof(T)));
  }
}

// An 80-, 160- or 176-wide tile's last 16, 32 or 48 columns where C has a map (rows 16-byte
// multiples, 16-byte aligned): 16 bytes a thread at a time from the staged chunk (a 64-column
// TMA box would write into the next tile's columns; value by value it cost ~2 us a tile)
template <class T, int COLS>
__device__ __forceinline__ void store_vectors(T* __restrict__ C, u32 buf, i64 M, i64 N, int col0,
                                              int row0, int t) {
  constexpr int V = 16 / (int)sizeof(T), VR = COLS / V;  // values a vector, vectors a row
  for (int c = t; c < 64 * VR; c += 128) {
    const int r = c / VR, v = c % VR;
    const i64 row = (i64)row0 + r, gcol = (i64)col0 + v * V;
    if (row < M && gcol < N) {
      uint4 x;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "r"(swizzled(buf, r, v * 16)));
      *reinterpret_cast<uint4*>(C + row * N + gcol) = x;
    }
  }
}

// The warpgroup's OUT_W columns of rows [row0, row0 + 64) of matrix z, from chunk C0 on
// (the next chunk by recursion: a loop over the chunks, even with #pragma unroll, left the
// accumulators in local memory). `n` counts the warpgroup's chunks so far (all tiles): its
// chunk goes to buffer n % 2, free once the store issued from it two chunks ago has read
// it. Thread 0 of the warpgroup waits for that and issues the stores; the others wait for
// it at the barrier, stage, fence their writes for the TMA and meet it again. Where C has
// no map (p.chunk != 0) every thread stores values instead; the next barrier but one comes
// after its reads of the buffer.
template <class T, int BN, int OUT_W, int C0 = 0>
__device__ __forceinline__ void store_tile(const float (&acc)[BN / 2], const TmaMap* map_c,
                                           T* __restrict__ C, const GemmParams& p, u32 buf0,
                                           u32& n, int bar, int w, int lane, int t, int col0,
                                           int row0, int z) {
  constexpr int CW = 128 / (int)sizeof(T);  // columns a chunk
  constexpr bool PART = C0 + CW > OUT_W;     // an 80-, 160- or 176-wide tile's last columns
  const bool values = p.chunk != 0;
  const u32 buf = buf0 + (n & 1u) * EPI_BYTES;
  if (t == 0 && !values) tma_store_read_wait<1>();
  named_sync(bar, 128);
  if constexpr (sizeof(T) == 4) {
    stage_chunk_f32<T, BN, C0>(acc, buf, w, lane);
  } else {
    stage_chunk<T, BN, C0>(acc, buf, w, lane);
  }
  if (values || PART) {
    named_sync(bar, 128);
    T* const c = C + (i64)z * p.m * p.p;
    const i64 end = PART && (i64)col0 + OUT_W < p.p ? (i64)col0 + OUT_W : p.p;
    if (PART && !values)
      store_vectors<T, PART ? OUT_W - C0 : CW>(c, buf, p.m, p.p, col0 + C0, row0, t);
    else
      store_values<T>(c, buf, p.m, p.p, col0 + C0, row0, t, end);
  } else {
    fence_async_shared();
    named_sync(bar, 128);
    if (t == 0) tma_store(map_c, buf, col0 + C0, row0, z);
  }
  n++;
  if constexpr (C0 + CW < OUT_W)
    store_tile<T, BN, OUT_W, C0 + CW>(acc, map_c, C, p, buf0, n, bar, w, lane, t, col0, row0,
                                      z);
}

// GLU: the tile's columns [0, W/2) are gate and [W/2, W) the same outputs' up products, and
// a thread holds gate column c and up column c + W/2 in accumulators 4i + j and 4(i + W/16)
// + j, so silu(gate) * up (each product rounded to T first: the numbers of the product and
// then nn.cu's swiglu) is formed in registers, into the first W/4 accumulators.
template <class T, int BN> __device__ __forceinline__ void swiglu_in_place(float (&acc)[BN / 2]) {
#pragma unroll
  for (int q = 0; q < BN / 4; q++) {
    const typename Acc<T>::type gate = load(store<T>(acc[q])), up = load(store<T>(acc[q + BN / 4]));
    acc[q] = load(store<T>(gate * sigmoid(gate) * up));
  }
}

// ---- the walk over the tiles --------------------------------------------------------------
// The kernel is persistent: its grid has at most one group per SM (the host sizes it), and
// each group computes tiles until none is left, taking first tile blockIdx.x and then the
// next unclaimed one from a counter in global memory (tiles are numbered over the batch,
// tile_of ordering each matrix's). Claiming in order, rather than striding by gridDim.x,
// keeps the tiles that run at once neighbours at the same k: a group that runs slow falls
// behind on its own instead of dragging its later tiles away from the ones that share their
// A rows and B columns in L2 (docs/cuda_notes.md v28).
// The producer claims and runs ahead across tile boundaries, so while the consumers write
// one tile out, the next tile's first stages are already loading: no group pays a launch
// and a pipeline fill per tile. It hands the tile to the consumers in ids[s] of the tile's
// first stage (written before the stage's full barrier is armed, so a consumer that has
// waited on it reads the id), and ends with id -1 on a stage armed without bytes. The stage
// counter `it` runs on over the tiles: k-tile `it` of the group's walk uses stage
// it % STAGES, phase (it / STAGES) & 1. counter[0] counts claims past the first tiles and
// counter[1] the groups done claiming; the last of those zeroes both for the next launch.
//
// GLU: B is a fused gate/up weight (2p rows: gate, then up) and C (m x p) = silu(A Gᵀ) *
// (A Uᵀ). A tile's B stage holds 128 gate rows and the 128 up rows of the same outputs, so
// the tile is the usual 128 x 256 product and its epilogue writes 128 columns.
template <class T, int BN, bool BN_MAJOR, bool GLU = false>
__device__ __forceinline__ void run(T* __restrict__ C, unsigned* counter, const GemmParams& p,
                                    const TmaMap* map_a, const TmaMap* map_b,
                                    const TmaMap* map_c, unsigned char* smem) {
  constexpr int STAGES = stages<BN>(), KS = k_tile<T>(), OUT_W = GLU ? BN / 2 : BN;
  constexpr u32 B_BYTES = BN * 128, STAGE_BYTES = A_BYTES + B_BYTES;
  const u32 base = (smem_u32(smem) + 1023u) & ~1023u;
  const u32 epi0 = base + STAGES * STAGE_BYTES, full0 = epi0 + 4 * EPI_BYTES;
  const u32 empty0 = full0 + STAGES * 8, ids0 = empty0 + STAGES * 8;
  const int tid = threadIdx.x, wg = tid / 128;
  const int tiles_m = (int)((p.m + BM - 1) / BM), tiles_n = (int)((p.p + OUT_W - 1) / OUT_W);
  const int tiles = tiles_m * tiles_n, total = tiles * (int)p.batch;  // host: < 2^31
  const int KT = (int)((p.n + KS - 1) / KS);

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
      u32 it = 0;
      for (int t = blockIdx.x;; t = (int)gridDim.x + (int)atomicAdd(counter, 1u)) {
        const int s0 = (int)(it % STAGES);
        bar_wait(empty0 + 8 * s0, ((it / STAGES) & 1u) ^ 1u);
        st_shared_i32(ids0 + 4 * s0, t < total ? t : -1);
        if (t >= total) {  // no tile left: the consumers end at this stage
          bar_arrive(full0 + 8 * s0);
          break;
        }
        int tm, tn;
        tile_of(t % tiles, tiles_m, tiles_n, tm, tn);
        const int m0 = tm * BM, n0 = tn * OUT_W, z = t / tiles;
        for (int kt = 0; kt < KT; kt++, it++) {
          const int s = (int)(it % STAGES);
          if (kt > 0) bar_wait(empty0 + 8 * s, ((it / STAGES) & 1u) ^ 1u);
          const u32 full = full0 + 8 * s, sa = base + s * STAGE_BYTES;
          bar_expect_tx(full, STAGE_BYTES);  // a box counts whole, zero-filled parts included
          tma_load(sa, map_a, full, kt * KS, m0, z);
          if (BN_MAJOR) {  // B (n x p): BN / 64 boxes of 64 columns x 64 k-rows
#pragma unroll
            for (int j = 0; j < BN / 64; j++)
              tma_load(sa + A_BYTES + j * (BK * 128), map_b, full, n0 + 64 * j, kt * KS, z);
          } else if (GLU) {  // boxes of BN / 2 rows: the gate rows, then the same outputs' up rows
            tma_load(sa + A_BYTES, map_b, full, kt * KS, n0, z);
            tma_load(sa + A_BYTES + OUT_W * 128, map_b, full, kt * KS, (int)p.p + n0, z);
          } else {
            tma_load(sa + A_BYTES, map_b, full, kt * KS, n0, z);
          }
        }
      }
      __threadfence();  // this group's last claim is made before it counts itself done
      if (atomicAdd(counter + 1, 1u) == gridDim.x - 1) {  // every group's last claim is made
        counter[0] = 0u;
        counter[1] = 0u;
      }
    }
  } else {
    // ------------------------------------------------------------------ consumers -----
    // Each consumer warpgroup owns 64 rows x BN columns of the tile. It waits on full[s],
    // issues the stage's 4 wgmmas and keeps that batch in flight while it waits for the
    // previous batch (wgmma.wait_group 1); once that has completed, its stage is released
    // (one arrive per consumer warp on empty[s]).
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int g = wg - 1, lane = tid % 32, w = (tid % 128) / 32;
    const u32 buf0 = epi0 + g * 2 * EPI_BYTES;
    float acc[BN / 2];
    u32 chunks = 0;  // this warpgroup's chunks stored so far (store_tile)
    for (u32 it = 0;;) {
      const int s0 = (int)(it % STAGES);
      bar_wait(full0 + 8 * s0, (it / STAGES) & 1u);
      // lane 0 reads the id and, later, releases the stage: the read is ordered before the
      // producer's next write of the slot by that thread's own arrive
      const int t = __shfl_sync(0xffffffffu, lane == 0 ? ld_shared_i32(ids0 + 4 * s0) : 0, 0);
      if (t < 0) break;
#pragma unroll
      for (int q = 0; q < BN / 2; q++) acc[q] = 0.f;
      for (int kt = 0; kt < KT; kt++, it++) {
        const int s = (int)(it % STAGES);
        if (kt > 0) bar_wait(full0 + 8 * s, (it / STAGES) & 1u);
        const u32 sa = base + s * STAGE_BYTES + g * 64 * 128, sb = base + s * STAGE_BYTES + A_BYTES;
        wg::fence_acc(acc);
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)  // 32 bytes of k each (k16 of 2-byte types, k8 of TF32)
          wg::Mma<T, BN, BN_MAJOR>::run(acc, wg::desc(sa + kk * 32),
                                        BN_MAJOR ? desc_mn(sb + kk * 16 * 128)
                                                 : wg::desc(sb + kk * 32));
        wg::commit();
        wg::wait<1>();  // the previous k-tile's batch has completed: its stage may be refilled
        wg::fence_acc(acc);
        if (kt > 0 && lane == 0) bar_arrive(empty0 + 8 * ((it - 1) % STAGES));
      }
      wg::wait<0>();
      wg::fence_acc(acc);
      if (lane == 0) bar_arrive(empty0 + 8 * ((it - 1) % STAGES));  // the tile's last stage
      int tm, tn;
      tile_of(t % tiles, tiles_m, tiles_n, tm, tn);
      if (GLU) swiglu_in_place<T, BN>(acc);
      store_tile<T, BN, OUT_W>(acc, map_c, C, p, buf0, chunks, 2 + g, w, lane, tid % 128,
                               tn * OUT_W, tm * BM + g * 64, t / tiles);
    }
    if (tid % 128 == 0 && !p.chunk) tma_store_wait();  // C written, shared memory read
  }
}
}  // namespace tma
#define GEMM_TMA_BODY(T, BN, BN_MAJOR, GLU)                                                    \
  extern __shared__ __align__(1024) unsigned char smem[];                                      \
  tma::run<T, BN, BN_MAJOR, GLU>(out, counter, p, &map_a, &map_b, &map_c, smem);
#else
// other targets: the names exist (every .cu compiles for sm_80 and sm_90 in CI); the host
// launches these only on sm_90a builds (device feature "tma")
#define GEMM_TMA_BODY(T, BN, BN_MAJOR, GLU) __trap();
#endif

// a and b are not read (the tensor maps address them; out only where C has no map); they are
// arguments so that graph capture keeps their buffers alive, like every other kernel's.
#define GEMM_TMA_GLU(NAME, T, BN, BN_MAJOR, GLU)                                               \
  extern "C" __global__ void __launch_bounds__(384, 1)                                         \
      NAME(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,              \
           unsigned* __restrict__ counter, GemmParams p, const __grid_constant__ TmaMap map_a, \
           const __grid_constant__ TmaMap map_b, const __grid_constant__ TmaMap map_c) {       \
    pdl_entry();                                                                               \
    GEMM_TMA_BODY(T, BN, BN_MAJOR, GLU)                                                        \
  }
#define GEMM_TMA(NAME, T, BN, BN_MAJOR) GEMM_TMA_GLU(NAME, T, BN, BN_MAJOR, false)
// Names: matmul_tma[W][_nn|_glu|_tf32]_{bf16,f16,f32}, W the tile width when not 256 (host:
// _tma_plan); W = 80, 160 and 176 (2,560 columns: 32 or 16 tiles; 11,264: 64) K-major bf16 /
// fp16 only.
// shared bytes: S * (128 + W) * 64 * 2 + 4 * 8192 + 20 * S + 1024, S = stages<W>()
#define GEMM_TMA_WIDTHS(SFX, T)                                                                \
  GEMM_TMA(matmul_tma_##SFX, T, 256, false) GEMM_TMA(matmul_tma_nn_##SFX, T, 256, true)        \
  GEMM_TMA(matmul_tma128_##SFX, T, 128, false) GEMM_TMA(matmul_tma128_nn_##SFX, T, 128, true)  \
  GEMM_TMA(matmul_tma64_##SFX, T, 64, false) GEMM_TMA(matmul_tma64_nn_##SFX, T, 64, true)   \
  GEMM_TMA(matmul_tma160_##SFX, T, 160, false) GEMM_TMA(matmul_tma176_##SFX, T, 176, false) \
  GEMM_TMA(matmul_tma80_##SFX, T, 80, false)
ONLY(bf16, GEMM_TMA_WIDTHS(bf16, bf16_t))
ONLY(f16, GEMM_TMA_WIDTHS(f16, half_t))
// A @ W^T with W a fused gate/up weight (2p, n), then swiglu: (m, p) outputs (matmul_swiglu)
ONLY(bf16, GEMM_TMA_GLU(matmul_tma_glu_bf16, bf16_t, 256, false, true))
ONLY(f16, GEMM_TMA_GLU(matmul_tma_glu_f16, half_t, 256, false, true))
// float32 as TF32 (ndl.set_float32_matmul_precision("high")): K-major B only
ONLY(f32, GEMM_TMA(matmul_tma_tf32_f32, float, 256, false)
          GEMM_TMA(matmul_tma128_tf32_f32, float, 128, false)
          GEMM_TMA(matmul_tma64_tf32_f32, float, 64, false))
