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
// 4 bytes global -> shared (bytes 0: zero)
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int bytes = 4) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
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
template <class T> struct Nibbles;
// A nibble u in the mantissa of 128 (bf16: 0x4300 | u) or 1024 (f16: 0x6400 | u) is 128 + u
// (1024 + u) exactly; one packed FMA with a bias takes the magic off (quant_skinny.cu,
// quant_gemm.cu). OR: the magic's bits (128 or 1024 in both halves); ONE; the packed biases
// -(M + 8), -M; the packed FMA of T
#define TC_NIBBLES(T, OR_, ONE_, SYM_, OFF_, FMA)                                              \
  template <> struct Nibbles<T> {                                                              \
    static constexpr u32 OR = OR_, ONE = ONE_, BIAS_SYM = SYM_, BIAS_OFF = OFF_;               \
    __device__ static u32 fma2(u32 a, u32 b, u32 c) {                                          \
      u32 d;                                                                                   \
      asm(FMA " %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));                          \
      return d;                                                                                \
    }                                                                                          \
  };
TC_NIBBLES(bf16_t, 0x43004300u, 0x3F803F80u, 0xC308C308u, 0xC300C300u, "fma.rn.bf16x2")
TC_NIBBLES(half_t, 0x64006400u, 0x3C003C00u, 0xE408E408u, 0xE400E400u, "fma.rn.f16x2")
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
// Pin the accumulators around an MMA batch (as CUTLASS does) so the compiler moves none of
// them while a wgmma may still write them; otherwise ptxas serializes the wgmmas (C7514).
template <int R> __device__ __forceinline__ void fence_acc(float (&d)[R]) {
#pragma unroll
  for (int q = 0; q < R; q++) asm volatile("" : "+f"(d[q])::"memory");
}

// d (64 x N, fp32, N/2 registers a thread) += A (64 x 16, descriptor da) times B (16 x N,
// descriptor db): wgmma.mma_async m64nNk16 for N = 64, 80, 128, 160, 176, 256 (T = bf16_t,
// half_t; T = float: TF32, k8, below). B_MN: B's tile is N-major (imm-trans-b = 1) instead
// of K-major.
#define WG_REGS32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
  "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_REGS40 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, " \
  "%34, %35, %36, %37, %38, %39}"
#define WG_REGS64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
  "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, " \
  "%33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, " \
  "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WG_REGS80 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, " \
  "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, " \
  "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}"
#define WG_REGS88 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
  "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, " \
  "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, " \
  "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
  "%82, %83, %84, %85, %86, %87}"
#define WG_REGS128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, " \
  "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, " \
  "%33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, " \
  "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, " \
  "%65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, " \
  "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, " \
  "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, " \
  "%110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, " \
  "%123, %124, %125, %126, %127}"
#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                 "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_D32(i) WG_D8(i), WG_D8(i + 8), WG_D8(i + 16), WG_D8(i + 24)
#define WG_D64(i) WG_D32(i), WG_D32(i + 32)
// operands after the R accumulators: %R descriptor A, %R+1 descriptor B, %R+2 scale-d (1).
// OP: the shape's k and the types ("k16.f32.bf16.bf16"); TAIL: the transpose immediates
// (", 0, 0" or ", 0, 1"; TF32 takes none)
#define WG_MMA_ASM(N, REGS, DA, DB, SCALE, OP, TAIL)                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                         \
  "wgmma.mma_async.sync.aligned.m64n" N OP " " REGS ", " DA ", " DB ", p, 1, 1" TAIL ";\n}\n"
#define WG_MMA_N64(OP, TAIL) \
  asm volatile(WG_MMA_ASM("64", WG_REGS32, "%32", "%33", "%34", OP, TAIL) \
               : WG_D32(0) : "l"(da), "l"(db), "r"(1))
#define WG_MMA_N80(OP, TAIL) \
  asm volatile(WG_MMA_ASM("80", WG_REGS40, "%40", "%41", "%42", OP, TAIL) \
               : WG_D32(0), WG_D8(32) : "l"(da), "l"(db), "r"(1))
#define WG_MMA_N128(OP, TAIL) \
  asm volatile(WG_MMA_ASM("128", WG_REGS64, "%64", "%65", "%66", OP, TAIL) \
               : WG_D64(0) : "l"(da), "l"(db), "r"(1))
#define WG_MMA_N160(OP, TAIL) \
  asm volatile(WG_MMA_ASM("160", WG_REGS80, "%80", "%81", "%82", OP, TAIL) \
               : WG_D64(0), WG_D8(64), WG_D8(72) : "l"(da), "l"(db), "r"(1))
#define WG_MMA_N176(OP, TAIL) \
  asm volatile(WG_MMA_ASM("176", WG_REGS88, "%88", "%89", "%90", OP, TAIL) \
               : WG_D64(0), WG_D8(64), WG_D8(72), WG_D8(80) : "l"(da), "l"(db), "r"(1))
#define WG_MMA_N256(OP, TAIL) \
  asm volatile(WG_MMA_ASM("256", WG_REGS128, "%128", "%129", "%130", OP, TAIL) \
               : WG_D64(0), WG_D64(64) : "l"(da), "l"(db), "r"(1))
template <class T, int N, bool B_MN> struct Mma;
#define WG_MMA_TYPE(T, OP, N, B_MN, TAIL)                                                    \
  template <> struct Mma<T, N, B_MN> {                                                       \
    __device__ static void run(float (&d)[N / 2], u64 da, u64 db) { WG_MMA_N##N(OP, TAIL); } \
  };
#define WG_MMA_SHAPES(T, OP)                                                                 \
  WG_MMA_TYPE(T, OP, 64, false, ", 0, 0") WG_MMA_TYPE(T, OP, 64, true, ", 0, 1")             \
  WG_MMA_TYPE(T, OP, 128, false, ", 0, 0") WG_MMA_TYPE(T, OP, 128, true, ", 0, 1")           \
  WG_MMA_TYPE(T, OP, 256, false, ", 0, 0") WG_MMA_TYPE(T, OP, 256, true, ", 0, 1")
WG_MMA_SHAPES(bf16_t, "k16.f32.bf16.bf16")
WG_MMA_SHAPES(half_t, "k16.f32.f16.f16")
// N = 80, 160 and 176 (K-major B only): the TMA GEMM's tiles for 2,560 and 11,264 columns
// (a 1.1B layer's fused q/k/v: 32 and 16 tiles; its gate/up: 64 tiles)
WG_MMA_TYPE(bf16_t, "k16.f32.bf16.bf16", 80, false, ", 0, 0")
WG_MMA_TYPE(half_t, "k16.f32.f16.f16", 80, false, ", 0, 0")
WG_MMA_TYPE(bf16_t, "k16.f32.bf16.bf16", 160, false, ", 0, 0")
WG_MMA_TYPE(half_t, "k16.f32.f16.f16", 160, false, ", 0, 0")
WG_MMA_TYPE(bf16_t, "k16.f32.bf16.bf16", 176, false, ", 0, 0")
WG_MMA_TYPE(half_t, "k16.f32.f16.f16", 176, false, ", 0, 0")
// float32 operands as TF32 (the low 13 mantissa bits ignored): m64nNk8, both operands
// K-major only (no transpose immediates), 8 elements = the same 32 bytes of a 128-byte row
// per instruction as k16 of a 2-byte type
WG_MMA_TYPE(float, "k8.f32.tf32.tf32", 64, false, "")
WG_MMA_TYPE(float, "k8.f32.tf32.tf32", 128, false, "")
WG_MMA_TYPE(float, "k8.f32.tf32.tf32", 256, false, "")
}  // namespace wg
#endif
