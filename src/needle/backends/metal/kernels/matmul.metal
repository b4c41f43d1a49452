// Matrix products (docs/kernels.md, "matmul").
//  * matmul_{nn,nt,tn,tt}_f32: 128x128 output tiles, 256 threads = 8 simd-groups, each
//    multiplying a 64x32 block with 8x8 simdgroup_float8x8 products over 16-deep K steps
//    staged in threadgroup memory (fp32 throughout: Apple GPUs have no reduced-precision
//    fp32 mode).
//  * matmul_{dt}: any dtype and layout, 16x16 tiles; for floats the 16x16 tile is four
//    simdgroup_float8x8 products (fp16/bf16 converted to fp32 in threadgroup memory), for
//    integers a plain dot product per thread. Threads (16, TY) with TY in {16, 8, 4, 2}: each
//    thread covers rows tid.y, tid.y + TY, ... of the tile, so a pipeline allowing fewer than
//    256 threads (register pressure) still runs it; it is also the fp32 fallback when the
//    128x128 kernel's pipeline allows fewer than its 256 threads.
//  * gemv_t_* / gemv_n_* / gemv_combine_*: m == 1 (decoding), bandwidth-bound.
#include <metal_stdlib>
using namespace metal;

struct MatmulParams {
  long m, n, p, batch, stride_a, stride_b, trans_a, trans_b, splits, chunk;
};

enum { BM = 128, BN = 128, BK = 16, SG_M = 64, SG_N = 32 };

// Element (r, c) of the (rows x cols) matrix X, stored row-major or, when `t`, transposed.
template <class T>
inline float at(device const T* x, long rows, long cols, long r, long c, bool t) {
  if (r >= rows || c >= cols) return 0.0f;
  return float(load(t ? x[c * rows + r] : x[r * cols + c]));
}

// Write an 8x8 product into C (ldc columns) at (r0, c0), clipping at (M, N). A fragment fully
// inside goes straight to memory; an edge one through the simd-group's 64-float scratch.
inline void store_fragment(simdgroup_float8x8 f, device float* C, long M, long N, long r0,
                           long c0, threadgroup float* scratch, uint lane) {
  if (r0 + 8 <= M && c0 + 8 <= N) {
    simdgroup_store(f, C + r0 * N + c0, ulong(N));
    return;
  }
  simdgroup_store(f, scratch, 8);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = lane; e < 64; e += 32) {
    const long r = r0 + e / 8, c = c0 + e % 8;
    if (r < M && c < N) C[r * N + c] = scratch[e];
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
}

template <bool TA, bool TB>
kernel void matmul_tiles_f32(device const float* a [[buffer(0)]],
                             device const float* b [[buffer(1)]], device float* out [[buffer(2)]],
                             constant MatmulParams& p [[buffer(3)]],
                             uint3 group [[threadgroup_position_in_grid]],
                             uint t [[thread_index_in_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float As[BM * BK];  // As[m][k]
  threadgroup float Bs[BK * BN];  // Bs[k][n]
  const long M = p.m, K = p.n, N = p.p;
  device const float* A = a + group.z * p.stride_a;
  device const float* B = b + group.z * p.stride_b;
  device float* C = out + group.z * M * N;
  const long m0 = long(group.y) * BM, n0 = long(group.x) * BN;
  const uint sm = (sg / 4) * SG_M, sn = (sg % 4) * SG_N;  // this simd-group's block

  simdgroup_float8x8 acc[SG_M / 8][SG_N / 8];
  for (int i = 0; i < SG_M / 8; i++)
    for (int j = 0; j < SG_N / 8; j++) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (long k0 = 0; k0 < K; k0 += BK) {
    for (uint e = t; e < BM * BK; e += 256) {  // A(m0 + r, k0 + c), B(k0 + r, n0 + c)
      const uint r = e / BK, c = e % BK;
      As[e] = at(A, M, K, m0 + r, k0 + c, TA);
      const uint kr = e / BN, nc = e % BN;
      Bs[e] = at(B, K, N, k0 + kr, n0 + nc, TB);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int kk = 0; kk < BK; kk += 8) {
      simdgroup_float8x8 bf[SG_N / 8];
      for (int j = 0; j < SG_N / 8; j++) simdgroup_load(bf[j], Bs + kk * BN + sn + j * 8, BN);
      for (int i = 0; i < SG_M / 8; i++) {
        simdgroup_float8x8 af;
        simdgroup_load(af, As + (sm + i * 8) * BK + kk, BK);
        for (int j = 0; j < SG_N / 8; j++) simdgroup_multiply_accumulate(acc[i][j], af, bf[j], acc[i][j]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  threadgroup float* scratch = As + sg * 64;  // As is free after the last barrier
  for (int i = 0; i < SG_M / 8; i++)
    for (int j = 0; j < SG_N / 8; j++)
      store_fragment(acc[i][j], C, M, N, m0 + sm + i * 8, n0 + sn + j * 8, scratch, lane);
}

INSTANTIATE("matmul_nn_f32", matmul_tiles_f32<false, false>)
INSTANTIATE("matmul_nt_f32", matmul_tiles_f32<false, true>)
INSTANTIATE("matmul_tn_f32", matmul_tiles_f32<true, false>)
INSTANTIATE("matmul_tt_f32", matmul_tiles_f32<true, true>)

// ---- any dtype, any layout: 16x16 output tiles, threads (16, 16) ----------------------------
#define GENERIC_ARGS                                                             \
  device const T* a [[buffer(0)]], device const T* b [[buffer(1)]],              \
      device T* out [[buffer(2)]], constant MatmulParams& p [[buffer(3)]],       \
      uint3 group [[threadgroup_position_in_grid]],                              \
      uint3 tid [[thread_position_in_threadgroup]],                              \
      uint3 tpg [[threads_per_threadgroup]],                                     \
      uint sg [[simdgroup_index_in_threadgroup]],                                \
      uint sgs [[simdgroups_per_threadgroup]]

// floats: the four 8x8 quadrants of the tile go round the simd-groups (one each with 256
// threads, all four with 32)
template <class T>
kernel void matmul_float(GENERIC_ARGS) {
  threadgroup float As[16 * 16], Bs[16 * 16];
  const long M = p.m, K = p.n, N = p.p;
  device const T* A = a + group.z * p.stride_a;
  device const T* B = b + group.z * p.stride_b;
  device T* C = out + group.z * M * N;
  const long row0 = long(group.y) * 16, col = long(group.x) * 16 + tid.x;
  simdgroup_float8x8 acc[4];
  for (int i = 0; i < 4; i++) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (long k0 = 0; k0 < K; k0 += 16) {
    for (uint y = tid.y; y < 16; y += tpg.y) {
      As[y * 16 + tid.x] = at(A, M, K, row0 + y, k0 + tid.x, p.trans_a != 0);
      Bs[y * 16 + tid.x] = at(B, K, N, k0 + y, col, p.trans_b != 0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = 0, q = sg; i < 4 && q < 4; i++, q += sgs) {
      const uint qr = (q / 2) * 8, qc = (q % 2) * 8;
      for (int kk = 0; kk < 16; kk += 8) {
        simdgroup_float8x8 af, bf;
        simdgroup_load(af, As + qr * 16 + kk, 16);
        simdgroup_load(bf, Bs + kk * 16 + qc, 16);
        simdgroup_multiply_accumulate(acc[i], af, bf, acc[i]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0, q = sg; i < 4 && q < 4; i++, q += sgs)
    simdgroup_store(acc[i], As + (q / 2) * 8 * 16 + (q % 2) * 8, 16);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint y = tid.y; y < 16; y += tpg.y)
    if (row0 + y < M && col < N) C[(row0 + y) * N + col] = store<T>(As[y * 16 + tid.x]);
}

// integers: a dot product per thread over 16-deep tiles (wrapping like numpy)
template <class T>
kernel void matmul_int(GENERIC_ARGS) {
  threadgroup T As[16 * 17], Bs[16 * 17];
  const long M = p.m, K = p.n, N = p.p;
  device const T* A = a + group.z * p.stride_a;
  device const T* B = b + group.z * p.stride_b;
  device T* C = out + group.z * M * N;
  const long row0 = long(group.y) * 16, col = long(group.x) * 16 + tid.x;
  T acc[8];  // rows tid.y + i * tpg.y (tpg.y >= 2)
  for (int i = 0; i < 8; i++) acc[i] = T(0);
  for (long k0 = 0; k0 < K; k0 += 16) {
    for (uint y = tid.y; y < 16; y += tpg.y) {
      const long row = row0 + y, ka = k0 + tid.x, kb = k0 + y;
      As[y * 17 + tid.x] = (row < M && ka < K) ? (p.trans_a ? A[ka * M + row] : A[row * K + ka]) : T(0);
      Bs[y * 17 + tid.x] = (kb < K && col < N) ? (p.trans_b ? B[col * K + kb] : B[kb * N + col]) : T(0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = 0, y = tid.y; y < 16; i++, y += tpg.y)
      for (int k = 0; k < 16; k++) acc[i] += As[y * 17 + k] * Bs[k * 17 + tid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0, y = tid.y; y < 16; i++, y += tpg.y)
    if (row0 + y < M && col < N) C[(row0 + y) * N + col] = acc[i];
}

#define GENERIC_FLOAT(unused, SFX, T) INSTANTIATE(NAME(matmul_##SFX), matmul_float<T>)
FLOATS(GENERIC_FLOAT, _)
INSTANTIATE("matmul_i32", matmul_int<int>)
INSTANTIATE("matmul_i64", matmul_int<long>)

// ---- m == 1 ---------------------------------------------------------------------------------
// out[j] = sum_k a[k] * B[j][k]: B stored (p, n); a simd-group per output
template <class T>
kernel void gemv_t(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]],
                   device T* out [[buffer(2)]], constant MatmulParams& p [[buffer(3)]],
                   uint3 group [[threadgroup_position_in_grid]],
                   uint3 tid [[thread_position_in_threadgroup]],
                   uint3 tpg [[threads_per_threadgroup]]) {
  const long j = long(group.x) * tpg.y + tid.y;
  if (j >= p.p) return;  // the whole simd-group
  device const T* row = b + j * p.n;
  float acc = 0.0f;
  for (long k = tid.x; k < p.n; k += 32) acc += load(row[k]) * load(a[k]);
  acc = simd_sum(acc);
  if (tid.x == 0) out[j] = store<T>(acc);
}

// part[s][j] = sum over split s's k of a[k] * B[k][j]: B stored (n, p); each lane owns V =
// 16 / sizeof(T) neighbouring columns, the simd-groups (tid.y) split k and meet in
// threadgroup memory (TY * 32 * V floats)
template <class T>
kernel void gemv_n(device const T* a [[buffer(0)]], device const T* b [[buffer(1)]],
                   device float* part [[buffer(2)]], constant MatmulParams& p [[buffer(3)]],
                   threadgroup float* smem [[threadgroup(0)]],
                   uint3 group [[threadgroup_position_in_grid]],
                   uint3 tid [[thread_position_in_threadgroup]],
                   uint3 tpg [[threads_per_threadgroup]]) {
  enum { V = 16 / sizeof(T) };
  const long N = p.p, K = p.n;
  const long j0 = (long(group.x) * 32 + tid.x) * V;
  const long k_begin = long(group.y) * p.chunk;
  const long k_end = lmin(k_begin + p.chunk, K);
  float acc[V];
  for (int e = 0; e < V; e++) acc[e] = 0.0f;
  if (j0 < N) {
    for (long k = k_begin + tid.y; k < k_end; k += tpg.y) {
      const float ak = load(a[k]);
      for (int e = 0; e < V; e++)
        if (j0 + e < N) acc[e] += ak * load(b[k * N + j0 + e]);
    }
  }
  for (int e = 0; e < V; e++) smem[(tid.y * 32 + tid.x) * V + e] = acc[e];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid.y == 0 && j0 < N) {
    for (uint y = 1; y < tpg.y; y++)
      for (int e = 0; e < V; e++) acc[e] += smem[(y * 32 + tid.x) * V + e];
    for (int e = 0; e < V; e++)
      if (j0 + e < N) part[group.y * N + j0 + e] = acc[e];
  }
}

template <class T>
kernel void gemv_combine(device const float* part [[buffer(0)]], device T* out [[buffer(1)]],
                         constant MatmulParams& p [[buffer(2)]], GRID_ARGS) {
  GRID_STRIDE(j, p.p) {
    float s = 0.0f;
    for (long q = 0; q < p.splits; q++) s += part[q * p.p + j];
    out[j] = store<T>(s);
  }
}

#define GEMV(unused, SFX, T)                                                     \
  INSTANTIATE(NAME(gemv_t_##SFX), gemv_t<T>)                                     \
  INSTANTIATE(NAME(gemv_n_##SFX), gemv_n<T>)                                     \
  INSTANTIATE(NAME(gemv_combine_##SFX), gemv_combine<T>)
FLOATS(GEMV, _)
