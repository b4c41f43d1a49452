// Prefill products with quantized weights on Hopper (sm_90a; docs/quantization.md, "prefill"):
//   qgemm{8,4}{,o,g}_{bf16,f16}: out (m x n) = x (m x k) @ W^T, W int8 or int4 (n x k) with
//   float32 scales (and, suffix o, offsets) per group of values along k.
// gpu/quant.py otherwise dequantizes W into a workspace and runs the bf16 GEMM; writing and
// reading that workspace cost 1.4-1.85x the bf16 GEMM's time. Here W is dequantized in
// registers, as the warpgroup MMA's A operand, and never exists in T in memory:
//  * The product is computed transposed, out^T (n x m) = W x^T: a tile is 128 weight rows
//    (two consumer warpgroups of 64, wgmma m64) by 128 tokens (wgmma n128) or, kernels
//    `_t256`, 256 (n256: each W fragment serves twice the tokens; products of many tiles,
//    cuda_notes v36), k in steps (KT) of 128 (kernels `_k128`: int4 dequantized value by
//    value, where they measured faster on the H100, cuda_notes v35) or 64 (everything else:
//    int8, the exact form, k not a multiple of 128, groups of 16, 256-token tiles).
//  * A producer thread loads each stage by TMA: x's tile of tokens x KT values (boxes of 64,
//    128-byte swizzle, the wgmma's K-major B operand, as gemm_tma.cu's B), the 128 rows'
//    packed words of the KT values and their scales (and offsets): a box of 4 groups a row,
//    or one scale a row for a matrix of one group a row.
//  * A consumer thread holds rows r and r + 8 of its warp's 16 (r = lane / 4) at k 2t, 2t+1,
//    2t+8, 2t+9 of each k16 step (t = lane % 4): the wgmma's register fragment of A, built
//    from the stage's packed bytes (Mode, below) while the previous stage's wgmmas run (two
//    fragment sets).
// The grid is persistent: one group an SM, each taking an equal share of the product's k
// steps numbered tile by tile (stream-K, `Shares`), so that products of fewer tiles than SMs,
// or a few more, keep every SM busy; a tile that shares split is summed by its owner, the
// group holding its first k steps (`gather`: its producer copies the other groups' parts into
// the ring, `fetch_parts`). The producer runs ahead across tiles. The host
// (cuda/quant_gemm.py) takes it by default up to 256 tokens, up to 768 where each group's
// share is at least a 2,048-wide tile's k steps, and up to 2,048 with two or more 256-token
// tiles a group, where it beat the workspace form on the H100; its loop is latency-bound
// with two consumer warps a scheduler (docs/cuda_notes.md v31-v32, v35-v36), so its
// per-stage instructions are kept few: counters, not divisions, a stage.
#include "common.cuh"
#include "mbarrier.cuh"
#include "tensor_core.cuh"

// m, n, k, log2 of the group's values, flags (1: one scale a row, read as a box of 128 rows;
// otherwise groups of a power of two >= 16 values), k steps a chunk and chunks a tile (the
// units of work the grid shares out: a group's k steps in EXACT mode, else one k step)
struct QuantGemmParams { i64 m, n, k, group_shift, flags, chunk, chunks; };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace qg {
constexpr int ROWS = 128, XK = 64;  // XK: values an x box
constexpr u32 S_BYTES = ROWS * 4 * 4;
// consumer threads: each arrives on a stage's empty barrier itself (its own reads of the
// stage are then ordered before the refill, which racecheck can follow; lane 0 arriving for
// its warp was also 2-6% slower on int8: cuda_notes v37)
constexpr u32 CONSUMERS = 256;
// bytes of an x box of TK tokens (a tile's)
template <int TK> __device__ constexpr u32 x_box() { return TK * XK * 2; }
// pipeline stages for 64- and 128-value k steps and TK tokens a tile (cuda/quant_gemm.py's
// STAGES sizes the shared memory from them): 6 fill it at 64 values; at 128, 4 and 5 measured
// the same (cuda_notes v35); 256 tokens: 5 of 64 values (x's boxes twice the bytes)
template <int KT, int TK> __device__ constexpr int stages() {
  return TK == 256 ? 5 : KT == 64 ? 6 : 4;
}
template <int BITS, int KT> __device__ constexpr u32 w_bytes() { return ROWS * KT * BITS / 8; }
// a stage: x | W | scales | offsets (each a multiple of 1 KiB: x stays 1024-byte aligned)
template <int BITS, int KT, int TK> __device__ constexpr u32 stage_bytes() {
  return TK * KT * 2 + w_bytes<BITS, KT>() + 2 * S_BYTES;
}

// d (64 x TK fp32) (+)= A (64 x 16, 4 registers a thread) times B (16 x TK, descriptor db);
// acc = 0: d = A B (the first product of a group). TK = 128 or 256 tokens.
template <class T, int TK> struct MmaRegA;
// A, DB, ACC: the operands after the TK / 2 accumulators (a's four registers, db, acc)
#define QG_MMA(T, TYPES, TK, REGS, A, DB, ACC, D)                                              \
  template <> struct MmaRegA<T, TK> {                                                          \
    __device__ static void run(float (&d)[TK / 2], const u32 (&a)[4], u64 db, int acc) {       \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACC ", 0;\n"                            \
                   "wgmma.mma_async.sync.aligned.m64n" #TK "k16.f32" TYPES " " REGS            \
                   ", " A ", " DB ", p, 1, 1, 0;\n}\n"                                         \
                   : D                                                                         \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));           \
    }                                                                                          \
  };
#define QG_COMMA ,
#define QG_MMA_TYPE(T, TYPES)                                                                  \
  QG_MMA(T, TYPES, 128, WG_REGS64, "{%64, %65, %66, %67}", "%68", "%69", WG_D64(0))            \
  QG_MMA(T, TYPES, 256, WG_REGS128, "{%128, %129, %130, %131}", "%132", "%133",                \
         WG_D64(0) QG_COMMA WG_D64(64))
QG_MMA_TYPE(bf16_t, ".bf16.bf16")
QG_MMA_TYPE(half_t, ".f16.f16")

// bytes of (a, b) picked by the selector's nibbles (PTX prmt: a's bytes 0-3, b's 4-7)
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
// (x & 0x000F000F) | c in one instruction (c a register: a LOP3 takes one immediate)
__device__ __forceinline__ u32 low_nibbles(u32 x, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(d) : "r"(x), "r"(c));
  return d;
}

// int4: lane t's values of one k16 step and row from its two packed words a (values 0-7)
// and b (8-15), as the integers u - 8 (or u: `bias2`) exactly in T: h0 = values 2t, 2t + 8,
// h1 = 2t + 1, 2t + 9. One byte permute brings byte t of a and of b to bytes 0 and 2
// (`sel`), a LOP3 each puts the low and the high nibbles under the magic, a packed FMA each
// takes the magic (and bias) off: no shift a word (cuda_notes v35).
template <class T>
__device__ __forceinline__ void nibble_halves(u32 a, u32 b, u32 sel, u32 magic_or, u32 bias2,
                                              u32& h0, u32& h1) {
  typedef tc::Nibbles<T> N;
  const u32 x = prmt(a, b, sel);
  h0 = N::fma2(low_nibbles(x, magic_or), N::ONE, bias2);
  h1 = N::fma2(low_nibbles(x >> 4, magic_or), N::ONE, bias2);
}

// How a fragment's values are made (the kernel's suffix):
//  DEQUANT ("", "o"): as dequant{8,4} makes them: (u - 8) s, b s or u s + o in float32,
//    rounded to T; the products are the workspace GEMM's, summed in another order.
//  EXACT ("g"; symmetric, one group a row or groups of whole k steps: int8 from 64 values,
//    int4 from 128, cuda/quant_gemm.py's exact_form): the integers u - 8 or b,
//    exact in T; each group's products are summed in fp32 and scaled once (the reference's
//    float32 weights, never rounded to T; qmv's and quant_skinny.cu's numbers).
enum Mode { DEQUANT = 0, EXACT = 1 };

// The A fragments of one stage (KT / 16 k16 steps x 4 registers) for rows r and r + 8
// (local to the tile), from the stage's packed words `w` (a row's KT * BITS / 32 words),
// scales `sc` and offsets `of` (a row's 4 groups, or 1 value with one group a row; DEQUANT
// only). A row's words are read 64 values at a time (fewer registers live at once).
template <class T, int BITS, bool OFF, int MODE, int KT>
__device__ __forceinline__ void fragments(u32 (&f)[KT / 16][4], const u32* w, const float* sc,
                                          const float* of, int r, int t, int kt,
                                          const QuantGemmParams& p) {
  constexpr int WR = KT * BITS / 32, WH = 64 * BITS / 32;  // words a row: a stage, 64 values
  const bool per_row = p.flags & 1;
  // int8: a byte u (the value + 128) in the mantissa of 2^23 by one permute (bytes 1-3 from
  // 0x4B000000: 0x4B0000uu is the float 2^23 + u), less 2^23 + 128: the value exactly
  const float bias = 8388736.f;
  const u32 sel8 = 2 * (t & 1) + 0x7540u;  // byte 2(t % 2) of the word, then 0, 0, 0x4B
  const u32 sel = t * 0x11u + (t + 4) * 0x1100u;  // nibble_halves: bytes t of a, b to 0 and 2
  // flags' top bit is never set: a value the compiler cannot fold, so the magic stays in a
  // register and low_nibbles is one LOP3 (which takes only one immediate)
  const u32 magic_or = tc::Nibbles<T>::OR | (u32)(p.flags & 0x80000000);
#pragma unroll
  for (int kh = 0; kh < KT / 64; kh++) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int row = r + 8 * h;
      u32 v[WH];
#pragma unroll
      for (int i = 0; i < WH / 4; i++) {
        const uint4 q = reinterpret_cast<const uint4*>(w + row * WR + kh * WH)[i];
        v[4 * i] = q.x, v[4 * i + 1] = q.y, v[4 * i + 2] = q.z, v[4 * i + 3] = q.w;
      }
#pragma unroll
      for (int q = 0; q < 4; q++) {
        float s = 1.f, o = 0.f;
        if (MODE == DEQUANT) {
          const int k16 = kt * KT + 64 * kh + 16 * q;
          const int gi = per_row ? 0 : (k16 >> (int)p.group_shift) & 3;
          s = sc[per_row ? row : row * 4 + gi];
          if (OFF) o = of[per_row ? row : row * 4 + gi];
        }
        if (BITS == 4) {  // registers k 2t, 2t+1 (e = 0) and 2t+8, 2t+9 (e = 1) of row h
          typedef tc::Nibbles<T> N;
          u32 h0, h1;
          nibble_halves<T>(v[2 * q], v[2 * q + 1], sel, magic_or,
                           OFF ? N::BIAS_OFF : N::BIAS_SYM, h0, h1);
          if (MODE == EXACT) {  // the integers are the values: pair the halves
            f[4 * kh + q][h] = prmt(h0, h1, 0x5410u);
            f[4 * kh + q][2 + h] = prmt(h0, h1, 0x7632u);
          } else {  // as dequant4 makes them: u - 8 (or u) in float32, scaled, rounded to T
            float a0, a8, a1, a9;
            tc::unpack2<T>(h0, a0, a8);
            tc::unpack2<T>(h1, a1, a9);
            auto value = [&](float a) { return OFF ? fmaf(a, s, o) : a * s; };
            f[4 * kh + q][h] = tc::pack2<T>(value(a0), value(a1));
            f[4 * kh + q][2 + h] = tc::pack2<T>(value(a8), value(a9));
          }
          continue;
        }
#pragma unroll
        for (int e = 0; e < 2; e++) {  // e = 0: k 16q + 2t, 2t+1; e = 1: 16q + 2t + 8, 2t + 9
          // int8: word 4q + 2e + t / 2 holds k 16q + 8e + 4(t / 2) ..; half t % 2 the two
          // (stored with the sign bit flipped: ^ 0x80 gives u = value + 128)
          const u32 word = ((t & 2) ? v[4 * q + 2 * e + 1] : v[4 * q + 2 * e]) ^ 0x80808080u;
          float a = __uint_as_float(prmt(word, 0x4B000000u, sel8)) - bias;
          float b = __uint_as_float(prmt(word, 0x4B000000u, sel8 + 1)) - bias;
          if (MODE == DEQUANT)  // as dequant8 makes them: scaled in float32, rounded to T
            a = OFF ? fmaf(a, s, o) : a * s, b = OFF ? fmaf(b, s, o) : b * s;
          f[4 * kh + q][2 * e + h] = tc::pack2<T>(a, b);
        }
      }
    }
  }
}

// this warpgroup's 64 rows x TK tokens of out (transposed: out is tokens x rows). Lanes
// 4 apart hold rows r and r ^ 1 of the same tokens: with n even, each lane stores two rows
// of one token as one 4-byte word (the even row's lane its first token, the odd's its second)
template <class T, int TK>
__device__ __forceinline__ void write_tile(const float (&d)[TK / 2], T* __restrict__ out,
                                           const QuantGemmParams& p, i64 row, i64 tok0,
                                           int lane) {
  const int t = lane & 3, odd = (lane >> 2) & 1;
  const bool pairs = (p.n & 1) == 0;
#pragma unroll
  for (int i = 0; i < TK / 8; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {  // row + 8h; tokens 8i + 2t and + 1
      const float a = d[4 * i + 2 * h], b = d[4 * i + 2 * h + 1];
      const float pa = __shfl_xor_sync(0xffffffffu, a, 4), pb = __shfl_xor_sync(0xffffffffu, b, 4);
      const i64 rr = row + 8 * h, token = tok0 + 8 * i + 2 * t;
      if (pairs) {
        const i64 tk = token + odd, r0 = rr - odd;  // r0 even, so r0 + 1 < n where r0 < n
        if (tk < p.m && r0 < p.n)
          *reinterpret_cast<u32*>(out + tk * p.n + r0) =
              odd ? tc::pack2<T>(pb, b) : tc::pack2<T>(a, pa);
      } else if (rr < p.n) {
        if (token < p.m) out[token * p.n + rr] = store<T>(a);
        if (token + 1 < p.m) out[(token + 1) * p.n + rr] = store<T>(b);
      }
    }
}

// The grid's shares of the work (stream-K): the product's chunks numbered tile by tile (a
// tile's k steps in order; the token tiles of one weight tile consecutive, so that they share
// W in L2), group j takes chunks [j W / G, (j + 1) W / G) of the W in all: whole tiles, and
// at either end a piece of a tile that other groups share. Every group gets the same work
// within a chunk, where whole tiles a group would leave SMs idle in a product's last wave
// (a 2048-row matrix at 512 tokens: 64 tiles for 132 SMs).
struct Shares {
  i64 chunks, total, groups;  // chunks a tile, W, G
  __device__ i64 begin(i64 j) const { return j * total / groups; }
  __device__ i64 owner(i64 c) const { return ((c + 1) * groups - 1) / total; }  // c's group
};
// a share's next piece: one tile's k steps [ks0, ks1), from chunk c on; c moves past it
struct Piece { int tile, ks0, ks1; };
__device__ __forceinline__ Piece next_piece(i64& c, i64 end, const Shares& sh, i64 chunk) {
  const i64 tile = c / sh.chunks, t0 = tile * sh.chunks, e = min(end, t0 + sh.chunks);
  const Piece pc{(int)tile, (int)((c - t0) * chunk), (int)((e - t0) * chunk)};
  c = e;
  return pc;
}

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
}

// A tile that several groups share (at most SPLIT + 1: the host's rule, share_count). Its
// owner is the group whose share holds its first k steps: it runs them last in its share,
// while the others run their pieces first in theirs (a group's share starts in at most one
// tile it does not own), so the owner seldom waits. The others leave their partial sums in
// ws (one slot a group, NA KiB: 64 with 128 tokens a tile, 128 with 256; a consumer
// thread's 16-byte words 4 KiB apart) and count themselves on the tile's counter (release).
// The owner's producer waits for the count (acquire; `fetch_parts`) and copies the parts
// into the ring, CHUNKS stages a part in group order, while the consumers run the piece's
// last stages; the consumers add each chunk to their own sums as it lands (`gather`). So the
// parts' reads overlap the piece's stages and each other (read from L2 by the consumers a
// part at a time after their last stage, they cost the 512-token gate/up product with
// 256-token tiles 2-3 us more: cuda_notes v37). No group waits for one before it, so no
// wait can close a cycle; a wait does need the groups after it to run, which one group a
// multiprocessor (the host's grid) gives wherever two multiprocessors are free. Summing by
// whichever group arrives last, with no waits, was slower (2-3 us on 512-token products:
// every piece wrote its sums; v32).
constexpr int CHUNKS = 4;  // a part's quarter (NA / 16 words a thread) fits a stage's x boxes
template <int NA> __device__ constexpr u32 chunk_bytes() { return NA * 256; }
struct Parts { i64 first; int count; };  // a split tile's owner and number of pieces
__device__ __forceinline__ Parts parts_of(int tile, const Shares& sh) {
  const i64 first = sh.owner((i64)tile * sh.chunks);
  return {first, (int)(sh.owner((i64)(tile + 1) * sh.chunks - 1) - first) + 1};
}
// the ring's stages past the producer's `it`, as the consumers take them
struct Ring { u32 base, sb, full0, empty0; int stages; };
// group j's slot of partial sums in ws (NA / 4 16-byte words a consumer thread, 4 KiB apart):
// the non-owners' stores and the owner's copies address it alike
template <int NA> __device__ __forceinline__ float4* part_slot(float4* ws, i64 j) {
  return ws + j * (NA / 4) * 256;
}

// the owner's producer thread, after its last stage: the other parts of `tile` into the ring
template <int NA>
__device__ __forceinline__ void fetch_parts(float4* __restrict__ ws,
                                            unsigned* __restrict__ counters, int tile,
                                            const Shares& sh, const Ring& ring, u32& it) {
  const Parts pt = parts_of(tile, sh);
  unsigned have;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n"
                 : "=r"(have) : "l"(counters + tile) : "memory");
  } while (have != (unsigned)(pt.count - 1));
  counters[tile] = 0u;  // every other part has counted itself: none touches it again
  // the parts were written through the generic proxy; the bulk copies read through the async
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  constexpr u32 CB = chunk_bytes<NA>();
  for (int i = 1; i < pt.count; i++) {
    const char* part = reinterpret_cast<const char*>(part_slot<NA>(ws, pt.first + i));
    for (int q = 0; q < CHUNKS; q++, it++) {
      const int s = (int)(it % ring.stages);
      const u32 full = ring.full0 + 8 * s;
      bar_wait(ring.empty0 + 8 * s, ((it / ring.stages) & 1u) ^ 1u);
      bar_expect_tx(full, CB);
      bulk_copy(ring.base + s * ring.sb, part + q * CB, CB, full);
    }
  }
}

// A consumer's end of a split tile: a non-owner leaves its sums and returns false; the owner
// adds the other parts as `fetch_parts` lands them (slot / phase: the consumers' place in the
// ring) and returns true with the tile's total in acc
template <int NA>
__device__ __forceinline__ bool gather(float (&acc)[NA], float4* __restrict__ ws,
                                       unsigned* __restrict__ counters, int tile,
                                       const Shares& sh, const Ring& ring,
                                       const unsigned char* gbase, u32& slot, u32& phase) {
  const int ct = threadIdx.x - 128;
  const Parts pt = parts_of(tile, sh);
  if (blockIdx.x != pt.first) {
    float4* mine = part_slot<NA>(ws, blockIdx.x) + ct;
#pragma unroll
    for (int i = 0; i < NA / 4; i++)
      __stcg(mine + 256 * i,
             make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
    consumers_sync();  // every thread's words are written before the count (cumulative release)
    if (ct == 0)
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counters + tile) : "memory");
    return false;
  }
  constexpr int CW = NA / 16;  // a thread's words a chunk
  for (int i = 1; i < pt.count; i++) {  // in group order, as the parts land
#pragma unroll
    for (int q = 0; q < CHUNKS; q++) {
      bar_wait(ring.full0 + 8 * slot, phase);
      const float4* c = reinterpret_cast<const float4*>(gbase + slot * ring.sb) + ct;
#pragma unroll
      for (int u = 0; u < CW; u++) {
        const float4 v = c[256 * u];
        float* a = acc + 4 * (q * CW + u);
        a[0] += v.x, a[1] += v.y, a[2] += v.z, a[3] += v.w;
      }
      bar_arrive(ring.empty0 + 8 * slot);  // this thread's reads of the slot are done
      if (++slot == (u32)ring.stages) slot = 0, phase ^= 1u;
    }
  }
  consumers_sync();  // converged again for write_tile's shuffles (else emulated lane by lane)
  return true;
}

template <class T, int BITS, bool OFF, int MODE, int KT, int TK>
__device__ __forceinline__ void run(T* __restrict__ out, float4* __restrict__ ws,
                                    unsigned* __restrict__ counters, const QuantGemmParams& p,
                                    const TmaMap* map_x, const TmaMap* map_w,
                                    const TmaMap* map_s, const TmaMap* map_o,
                                    unsigned char* smem) {
  constexpr u32 XB = TK * KT * 2, WB = w_bytes<BITS, KT>(), SB = stage_bytes<BITS, KT, TK>();
  constexpr u32 X_BOX = x_box<TK>();
  constexpr int WR = KT * BITS / 32, NA = TK / 2;  // NA: accumulators a thread
  constexpr int STAGES = stages<KT, TK>(), KS16 = KT / 16;  // KS16: k16 steps (wgmmas) a stage
  // 256 tokens: 128 sums a thread leave no registers for the exact form's second set
  static_assert(TK == 128 || (TK == 256 && MODE == DEQUANT && KT == 64), "no such kernel");
  static_assert(chunk_bytes<NA>() <= XB, "a copied part's chunk lands in a stage's x boxes");
  const u32 base = (tc::smem_u32(smem) + 1023u) & ~1023u;
  unsigned char* gbase = smem + (base - tc::smem_u32(smem));
  const u32 full0 = base + STAGES * SB, empty0 = full0 + STAGES * 8;
  const Ring ring{base, SB, full0, empty0, STAGES};
  const int tid = threadIdx.x, wg = tid / 128;
  const int tiles_m = (int)((p.m + TK - 1) / TK), tiles_n = (int)((p.n + ROWS - 1) / ROWS);
  const int KS = (int)(p.k / KT);
  const bool per_row = p.flags & 1;
  const u32 s_bytes = per_row ? ROWS * 4 : S_BYTES;
  const Shares sh{p.chunks, (i64)tiles_m * tiles_n * p.chunks, (i64)gridDim.x};
  const i64 share_end = sh.begin(blockIdx.x + 1);

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; s++) {
      bar_init(full0 + 8 * s, 1);
      bar_init(empty0 + 8 * s, CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------------- producer -------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid != 0) return;
    tma_prefetch(map_x);
    tma_prefetch(map_w);
    tma_prefetch(map_s);
    if (OFF) tma_prefetch(map_o);
    u32 it = 0;
    Piece last{0, 1, 1};  // the share's last piece (none: not a tile's first k steps)
    for (i64 c = sh.begin(blockIdx.x); c < share_end;) {
      const Piece pc = next_piece(c, share_end, sh, p.chunk);
      last = pc;
      const int m0 = (pc.tile % tiles_m) * TK, n0 = (pc.tile / tiles_m) * ROWS;
      for (int kt = pc.ks0; kt < pc.ks1; kt++, it++) {
        const int s = (int)(it % STAGES);
        bar_wait(empty0 + 8 * s, ((it / STAGES) & 1u) ^ 1u);
        const u32 full = full0 + 8 * s, at = base + s * SB;
        // EXACT reads scales only in a group's last stage (a box is 128 small rows: TMA
        // requests the stage need not wait for); with one group a row, the piece's last
        const bool scales = MODE == DEQUANT || (per_row ? kt + 1 == pc.ks1
                                                        : (kt + 1) % (int)p.chunk == 0);
        bar_expect_tx(full, XB + WB + (scales ? (OFF ? 2 : 1) * s_bytes : 0u));
#pragma unroll
        for (int b = 0; b < KT / XK; b++)
          tma_load(at + b * X_BOX, map_x, full, kt * KT + b * XK, m0, 0);
        tma_load(at + XB, map_w, full, kt * WR, n0, 0);
        // scales: the box of 4 groups holding this stage's (a stage spans 1, 2 or 4 groups,
        // never across a multiple of 4: the host checks), or one a row
        const int g4 = ((kt * KT) >> (int)p.group_shift) & ~3;
        if (scales) tma_load(at + XB + WB, map_s, full, per_row ? n0 : g4, per_row ? 0 : n0, 0);
        if (OFF)
          tma_load(at + XB + WB + S_BYTES, map_o, full, per_row ? n0 : g4, per_row ? 0 : n0, 0);
      }
    }
    // a tile's first k steps, not all of them: its owner's, the share's last piece (gather)
    if (last.ks0 == 0 && last.ks1 < KS) fetch_parts<NA>(ws, counters, last.tile, sh, ring, it);
    return;
  }
  // ------------------------------------------------------------------------ consumers ------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int g = wg - 1, lane = tid % 32, w = (tid % 128) / 32, t = lane & 3;
  const int r = 64 * g + 16 * w + lane / 4;  // the thread's first row in the tile
  float d[NA], sum[NA];  // sum: the scaled groups so far (EXACT; unused otherwise)
  u32 fa[KS16][4], fb[KS16][4];  // fragments of even and odd stages
  u32 slot = 0, phase = 0;  // the ring's next stage and the phase of its barriers' next use
  u32 held = ~0u;           // the slot whose shared memory the last wgmmas may still read
  int in_group = 0;         // EXACT: stages of the current group done
  int per_group = 1;        // EXACT: stages a group (the piece's, with one group a row)
  auto release = [&](u32 at) {
    if (at != ~0u) bar_arrive(empty0 + 8 * at);
  };
  // EXACT: a group's sums d are scaled into sum at the next stage (or the piece's end), after
  // that stage's fragments are built while the group's last wgmmas still run, and before its
  // wgmmas start d afresh (flushing at once cost gate/up ~1.3 us in 55: cuda_notes v32)
  u32 flush_slot = ~0u;  // the slot of the group's last stage, held until its wgmmas are done
  float fs0 = 0.f, fs8 = 0.f;  // its scales of rows r and r + 8
  auto flush = [&]() {
    if (MODE != EXACT || flush_slot == ~0u) return;
    wg::wait<0>();
    wg::fence_acc(d);
#pragma unroll
    for (int i = 0; i < NA; i++) sum[i] = fmaf((i & 2) ? fs8 : fs0, d[i], sum[i]);
    release(flush_slot);
    flush_slot = ~0u;
  };
  // one stage: fragments into f while the previous stage's wgmmas run, then its KS16 wgmmas;
  // afterwards the previous stage's have completed (its shared memory and fragment set free)
  auto stage = [&](u32 (&f)[KS16][4], int kt) {
    bar_wait(full0 + 8 * slot, phase);
    const unsigned char* st = gbase + slot * SB;
    const float* sc = reinterpret_cast<const float*>(st + XB + WB);
    fragments<T, BITS, OFF, MODE, KT>(f, reinterpret_cast<const u32*>(st + XB), sc,
                                      sc + ROWS * 4, r, t, kt, p);
    flush();
    // x's descriptor once a stage: a k16 step's is 32 bytes on (x box q / 4), which adds
    // (bytes >> 4) to the descriptor's start address field (no carry: shared memory < 256 KiB)
    const u64 xd = wg::desc(base + slot * SB);
    const bool fresh = MODE == EXACT && in_group == 0;
    wg::fence_acc(d);
    wg::fence();
#pragma unroll
    for (int q = 0; q < KS16; q++)
      MmaRegA<T, TK>::run(d, f[q], xd + ((q / 4) * X_BOX + (q % 4) * 32) / 16,
                          !(fresh && q == 0));
    wg::commit();
    wg::wait<1>();  // the previous stage's wgmmas are done
    wg::fence_acc(d);
    release(held);
    held = slot;                                     // released after the next stage's wgmmas,
    if (MODE == EXACT && ++in_group == per_group) {  // or, a group's last stage, by its flush
      in_group = 0;
      const int gi = per_row ? 0 : ((kt * KT) >> (int)p.group_shift) & 3;
      fs0 = sc[per_row ? r : r * 4 + gi], fs8 = sc[per_row ? r + 8 : (r + 8) * 4 + gi];
      flush_slot = slot;
      held = ~0u;
    }
    if (++slot == STAGES) slot = 0, phase ^= 1u;
  };
  for (i64 c = sh.begin(blockIdx.x); c < share_end;) {
    const Piece pc = next_piece(c, share_end, sh, p.chunk);
    const i64 m0 = (i64)(pc.tile % tiles_m) * TK, n0 = (i64)(pc.tile / tiles_m) * ROWS;
    per_group = per_row ? pc.ks1 - pc.ks0 : (int)p.chunk;
#pragma unroll
    for (int q = 0; q < NA; q++) {
      d[q] = 0.f;
      if (MODE == EXACT) sum[q] = 0.f;
    }
    int kt = pc.ks0;
    for (; kt + 1 < pc.ks1; kt += 2) {
      stage(fa, kt);
      stage(fb, kt + 1);
    }
    if (kt < pc.ks1) stage(fa, kt);
    flush();
    wg::wait<0>();
    wg::fence_acc(d);
    release(held);
    held = ~0u;
    // a whole tile is written at once; a shared one by the group that finishes it
    auto finish = [&](float(&acc)[NA]) {
      if (pc.ks1 - pc.ks0 == KS ||
          gather(acc, ws, counters, pc.tile, sh, ring, gbase, slot, phase))
        write_tile<T, TK>(acc, out, p, n0 + r, m0, lane);
    };
    if constexpr (MODE == EXACT)
      finish(sum);
    else
      finish(d);
  }
}
}  // namespace qg
#define QGEMM_BODY(T, BITS, OFF, MODE, KT, TK)                                                 \
  extern __shared__ __align__(1024) unsigned char smem[];                                      \
  qg::run<T, BITS, OFF, MODE, KT, TK>(out, reinterpret_cast<float4*>(ws), counters, p,       \
                                      &map_x, &map_w, &map_s, &map_o, smem);
#else
// other targets: the names exist; the host launches these only on sm_90a (device feature tma)
#define QGEMM_BODY(T, BITS, OFF, MODE, KT, TK) __trap();
#endif

// x, q, s and b are not read (the tensor maps address them); they are arguments so that graph
// capture keeps their buffers alive, like every other kernel's. Without offsets b is s and
// map_o is map_s (not read).
#define QGEMM(NAME, T, BITS, OFF, MODE, KT, TK)                                                \
  extern "C" __global__ void __launch_bounds__(384, 1)                                         \
      NAME(const T* __restrict__ x, const u32* __restrict__ q, const float* __restrict__ s,    \
           const float* __restrict__ b, T* __restrict__ out, float* __restrict__ ws,           \
           unsigned* __restrict__ counters, QuantGemmParams p,                                 \
           const __grid_constant__ TmaMap map_x, const __grid_constant__ TmaMap map_w,         \
           const __grid_constant__ TmaMap map_s, const __grid_constant__ TmaMap map_o) {       \
    pdl_entry();                                                                               \
    QGEMM_BODY(T, BITS, OFF, MODE, KT, TK)                                                     \
  }
// Names: qgemm{8,4}{,o,g}_{bf16,f16}: "" DEQUANT, "o" DEQUANT with offsets, "g" EXACT;
// qgemm4{,o}_k128_{bf16,f16}: int4 DEQUANT with 128-value k steps; qgemm{8,4}{,o}_t256_*:
// DEQUANT with 256 tokens a tile (64-value steps)
#define QGEMM_BITS(SFX, T, BITS)                                                               \
  QGEMM(qgemm##BITS##_##SFX, T, BITS, false, qg::DEQUANT, 64, 128)                             \
  QGEMM(qgemm##BITS##o_##SFX, T, BITS, true, qg::DEQUANT, 64, 128)                             \
  QGEMM(qgemm##BITS##g_##SFX, T, BITS, false, qg::EXACT, 64, 128)                              \
  QGEMM(qgemm##BITS##_t256_##SFX, T, BITS, false, qg::DEQUANT, 64, 256)                        \
  QGEMM(qgemm##BITS##o_t256_##SFX, T, BITS, true, qg::DEQUANT, 64, 256)
#define QGEMM_ALL(SFX, T)                                                                      \
  QGEMM_BITS(SFX, T, 8) QGEMM_BITS(SFX, T, 4)                                                  \
  QGEMM(qgemm4_k128_##SFX, T, 4, false, qg::DEQUANT, 128, 128)                                 \
  QGEMM(qgemm4o_k128_##SFX, T, 4, true, qg::DEQUANT, 128, 128)
ONLY(bf16, QGEMM_ALL(bf16, bf16_t))
ONLY(f16, QGEMM_ALL(f16, half_t))
