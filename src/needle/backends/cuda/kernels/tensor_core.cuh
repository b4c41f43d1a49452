// Tensor-core building blocks shared by matmul.cu and nn.cu (sm_80+): cp.async copies into
// shared memory, ldmatrix fragment loads, mma.sync m16n8k16 with fp32 accumulators, and
// packing two floats into one register of half-precision operands.
//
// Fragment layouts of mma.sync.m16n8k16 (g = lane / 4, t = lane % 4; the lower-indexed
// element of each pair in the low 16 bits):
//   A (16x16, row-major) a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   B (16x8, "col")      b0: (k 2t..2t+1, n g)  b1: (k 2t+8.., n g)
//   C (16x8)             c0,c1: (g, 2t..2t+1)  c2,c3: (g+8, 2t..2t+1)
#pragma once
#include "common.cuh"

namespace tc {
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// 16 bytes global -> shared; bytes < 16 zero-fills the rest (0: all zeros, src not read)
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// four 8x8 b16 matrices; lane i gives the address of row i % 8 of matrix i / 8 and gets,
// of each matrix, (row lane/4, cols 2(lane%4), +1), or with .trans (rows 2(lane%4), +1, col lane/4)
__device__ __forceinline__ void ldsm_x4(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// byte offset of 16-byte chunk ch of row r in a [rows][D] tile of 2-byte elements stored with
// chunk c of row r at c ^ (r & 7): eight consecutive rows' chunk ch fall in different banks, so
// ldmatrix reads them without conflicts
template <int D> __device__ __forceinline__ u32 swz(int r, int ch) {
  return (u32)(r * D + ((ch ^ (r & 7)) << 3)) * 2u;
}
__device__ __forceinline__ float ex2(float x) {  // 2^x; 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
template <class T> struct Mma;
template <> struct Mma<bf16_t> {
  __device__ static void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct Mma<half_t> {
  __device__ static void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
// (lo, hi) rounded to nearest into one register: lo in the low 16 bits
template <class T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<bf16_t>(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ u32 pack2<half_t>(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// the two values of pack2's register back as floats
template <class T> __device__ __forceinline__ void unpack2(u32 v, float& lo, float& hi);
template <> __device__ __forceinline__ void unpack2<bf16_t>(u32 v, float& lo, float& hi) {
  asm("mov.b32 %0, %1;" : "=f"(lo) : "r"(v << 16));
  asm("mov.b32 %0, %1;" : "=f"(hi) : "r"(v & 0xffff0000u));
}
template <> __device__ __forceinline__ void unpack2<half_t>(u32 v, float& lo, float& hi) {
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi) : "r"(v));
}
// (lo, hi) as two registers whose sum carries about twice T's precision: the rounded pair and
// the rounded remainders (an mma with each adds a product of float-like accuracy)
template <class T> __device__ __forceinline__ void split2(float lo, float hi, u32& big, u32& rest) {
  big = pack2<T>(lo, hi);
  float l, h;
  unpack2<T>(big, l, h);
  rest = pack2<T>(lo - l, hi - h);
}
}  // namespace tc

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Hopper warpgroup MMA (sm_90a), shared by matmul.cu (cp.async-fed) and gemm_tma.cu
// (TMA-fed). desc: the shared-memory matrix descriptor of a K-major tile stored in 128-byte
// rows with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r & 7), tile 1024-byte
// aligned), which is also what TMA's CU_TENSOR_MAP_SWIZZLE_128B writes for a box 64 elements
// wide; stepping k by 16 elements adds 32 bytes to the start address.
namespace wg {
__device__ __forceinline__ u64 desc(u32 smem_addr) {
  u64 d = (u64)((smem_addr & 0x3FFFF) >> 4);  // start address
  d |= (u64)(16 >> 4) << 16;                   // leading byte offset (unused: swizzled K-major)
  d |= (u64)(1024 >> 4) << 32;                 // stride byte offset: 8 rows x 128 bytes
  d |= (u64)1 << 62;                           // 128-byte swizzle
  return d;
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// wait until at most N committed groups are pending
template <int N> __device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
}  // namespace wg
#endif
