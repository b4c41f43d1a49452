// Helpers of the float32 attention kernels as register-tiled products (attention_simt.cu,
// attention_simt_bwd.cu): 16-byte shared-memory rows, the half-warp reductions over a row's
// 16 lanes, and the 4 x 4 blocks a thread of a 16 x 16 group computes.
#pragma once

namespace simt {
__device__ __forceinline__ float4 ld4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void st4(float* p, float4 x) { *reinterpret_cast<float4*>(p) = x; }
__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}
__device__ __forceinline__ float half_warp_max(float x) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
// s[i][c] = A's row ty + 16 i . B's row tx + 16 c over D floats, rows LD floats apart in
// shared memory (S = Q Kᵀ, dP = dO Vᵀ); the loop over d unrolled UNROLL times
template <int D, int LD, int UNROLL>
__device__ __forceinline__ void row_dots(const float* A, const float* B, int ty, int tx,
                                         float (&s)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int c = 0; c < 4; c++) s[i][c] = 0.f;
#pragma unroll UNROLL
  for (int d = 0; d < D; d += 4) {
    float4 a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; i++) a[i] = ld4(A + (ty + 16 * i) * LD + d);
#pragma unroll
    for (int c = 0; c < 4; c++) b[c] = ld4(B + (tx + 16 * c) * LD + d);
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int c = 0; c < 4; c++) s[i][c] = dot4(a[i], b[c], s[i][c]);
  }
}

// acc[i][c] += a_i b_c: one step of a product whose thread block is 4 x 4
__device__ __forceinline__ void outer4(float (&acc)[4][4], float4 a, float4 b) {
  const float ai[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    acc[i][0] = fmaf(ai[i], b.x, acc[i][0]);
    acc[i][1] = fmaf(ai[i], b.y, acc[i][1]);
    acc[i][2] = fmaf(ai[i], b.z, acc[i][2]);
    acc[i][3] = fmaf(ai[i], b.w, acc[i][3]);
  }
}

// acc[i][c] += a[i].k b[k].c for k = 0..3 in order: four steps of a product whose thread
// block is 4 x 4, a[i] holding four k's of its row i and b[k] four columns of row k
// (O += P V in the forward, dK += dSᵀ Q in the backward)
__device__ __forceinline__ void rows4_times4(float (&acc)[4][4], const float4 (&a)[4],
                                             const float4 (&b)[4]) {
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float ai[4] = {a[i].x, a[i].y, a[i].z, a[i].w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
      acc[i][0] = fmaf(ai[k], b[k].x, acc[i][0]);
      acc[i][1] = fmaf(ai[k], b[k].y, acc[i][1]);
      acc[i][2] = fmaf(ai[k], b[k].z, acc[i][2]);
      acc[i][3] = fmaf(ai[k], b[k].w, acc[i][3]);
    }
  }
}
}  // namespace simt
