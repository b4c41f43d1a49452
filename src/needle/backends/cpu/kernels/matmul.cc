// Matrix multiplication: a GotoBLAS-style blocked GEMM around a register-tiled micro-kernel
// written with GCC/Clang vector extensions (AVX-512, AVX2, SSE or NEON, whichever the build
// targets), plus a matrix-vector path for m == 1 (decoding one token).
//
// Blocking: for each KC-deep slab of the inner dimension, A is packed once into MR-row panels
// (up to MB rows at a time; this slab lives in L3), then B is packed block by block (KC x NC,
// sized to stay in L2) into NR-column panels. The macro-kernel holds one A panel in L1 while
// it sweeps the B panels of the block; the micro-kernel keeps an MR x NR tile of C in
// registers. Every element of A and B is packed exactly once per slab. fp16/bf16 are widened
// to fp32 while packing and rounded once when C is stored; integers multiply in unsigned
// arithmetic (wrapping as numpy's). One large matrix is shared by all threads (packing and
// tiles handed out dynamically); a batch of small ones gives each thread whole matrices.
#include <cmath>
#include <nanobind/stl/optional.h>

#include <optional>
#include <type_traits>

#include "common.h"
#include "matmul.h"

namespace needle {
namespace {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int kRegs = 32;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
constexpr int kRegs = 16;
#elif defined(__aarch64__) || defined(__ARM_NEON)
constexpr int kVecBytes = 16;
constexpr int kRegs = 32;
#else
constexpr int kVecBytes = 16;  // SSE2, or plain scalar code generated from the vector types
constexpr int kRegs = 16;
#endif

template <class T> struct Vec { typedef T type __attribute__((vector_size(kVecBytes))); };
template <class T> using vec_t = typename Vec<T>::type;

// Tile and block sizes per element type. MR x NV vectors of accumulators, NV vectors of B and
// one broadcast of A must fit the register file (6 x 4 zmm on AVX-512 and NEON's 32 registers,
// 6 x 2 ymm on AVX2's 16). A KC x NC block of B takes 512 KiB (half of a Zen 4 L2, a quarter
// of a Sapphire Rapids one); MB rows of packed A take 4 MiB of L3 (docs/cpu_notes.md).
template <class T> struct Config {
  static constexpr int L = kVecBytes / (int)sizeof(T);
  static constexpr int MR = 6;
  static constexpr int NV = kRegs == 32 ? 4 : 2;
  static constexpr int NR = NV * L;
  static constexpr int64_t KC = 512;
  static constexpr int64_t NC = 1024 / (int64_t)sizeof(T) / NR * NR;
  static constexpr int64_t MB = 2046;   // a multiple of MR
  static constexpr int64_t MC = 16 * MR;  // rows per work item of the thread team
};

// The compute type of a storage type inside GEMM.
template <class S> using gemm_t =
    std::conditional_t<std::is_same_v<S, int32_t>, uint32_t,
                       std::conditional_t<std::is_same_v<S, int64_t>, uint64_t,
                                          std::conditional_t<std::is_same_v<S, double>, double,
                                                             float>>>;

// A vector with every lane s: s - 0 is s exactly (even for -0.0 and NaN), so the compiler
// folds it into one broadcast (0 + s is not the identity for s = -0.0 and would be computed).
template <class T> inline vec_t<T> splat(T s) { return s - vec_t<T>{}; }

// C[MR x NR] (+)= A-panel . B-panel over kc steps; pa is kc x MR, pb kc x NR (aligned).
template <class T>
void micro_kernel(int64_t kc, const T* __restrict pa, const T* __restrict pb, T* __restrict c,
                  int64_t ldc, bool overwrite) {
  using V = vec_t<T>;
  constexpr int MR = Config<T>::MR, NV = Config<T>::NV, L = Config<T>::L, NR = Config<T>::NR;
  V acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = V{};
  for (int64_t k = 0; k < kc; ++k) {
    V b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = *(const V*)(pb + k * NR + v * L);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const V a = splat(pa[k * MR + r]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      T* cp = c + r * ldc + v * L;
      V cur = acc[r][v];
      if (!overwrite) {
        V old;
        std::memcpy(&old, cp, sizeof(V));
        cur += old;
      }
      std::memcpy(cp, &cur, sizeof(V));
    }
}

// Pack rows [0, rows) (rows <= MR) x cols [0, kc) of A (A(i,k) = a[i*ars + k*acs]) into one
// panel stored k-major (kc x MR), zero-padded to MR rows.
template <class T, class S>
void pack_a_panel(T* __restrict d, const S* a, int64_t ars, int64_t acs, int rows, int64_t kc) {
  constexpr int MR = Config<T>::MR;
  if (acs == 1) {
    for (int r = 0; r < rows; ++r) {
      const S* src = a + r * ars;
      for (int64_t k = 0; k < kc; ++k) d[k * MR + r] = widen<T>(src[k]);
    }
  } else {
    for (int64_t k = 0; k < kc; ++k) {
      const S* src = a + k * acs;
      for (int r = 0; r < rows; ++r) d[k * MR + r] = widen<T>(src[r * ars]);
    }
  }
  for (int r = rows; r < MR; ++r)
    for (int64_t k = 0; k < kc; ++k) d[k * MR + r] = T(0);
}

// Panel q of a packed A block (rows [q*MR, q*MR + MR) of the mb rows at a).
template <class T, class S>
void pack_a(T* dst, const S* a, int64_t ars, int64_t acs, int64_t mb, int64_t kc, int64_t q) {
  constexpr int MR = Config<T>::MR;
  pack_a_panel(dst + q * MR * kc, a + q * MR * ars, ars, acs,
               (int)std::min<int64_t>(MR, mb - q * MR), kc);
}

// Pack rows [0, kc) x cols [0, nc) of B (B(k,j) = b[k*brs + j*bcs]) into NR-column panels,
// each stored k-major (kc x NR), zero-padded to a multiple of NR columns.
template <class T, class S>
void pack_b(T* __restrict dst, const S* b, int64_t brs, int64_t bcs, int64_t kc, int64_t nc) {
  constexpr int NR = Config<T>::NR;
  for (int64_t jp = 0; jp < nc; jp += NR) {
    const int cols = (int)std::min<int64_t>(NR, nc - jp);
    T* d = dst + jp * kc;
    if (bcs == 1) {
      for (int64_t k = 0; k < kc; ++k) {
        const S* src = b + k * brs + jp;
        for (int j = 0; j < cols; ++j) d[k * NR + j] = widen<T>(src[j]);
        for (int j = cols; j < NR; ++j) d[k * NR + j] = T(0);
      }
    } else {  // transposed B: a transpose. Groups of 16 columns: 16 sequential read streams
      // (prefetcher friendly), and each 64-byte run of a packed row is written whole.
      for (int j0 = 0; j0 < NR; j0 += 16) {
        const int j1 = std::min(j0 + 16, NR);
        for (int64_t k = 0; k < kc; ++k)
          for (int j = j0; j < j1; ++j)
            d[k * NR + j] = j < cols ? widen<T>(b[(jp + j) * bcs + k * brs]) : T(0);
      }
    }
  }
}

// Per-thread packing buffers, grown on demand and kept across calls: a fresh multi-megabyte
// allocation per call costs page faults (and, with transparent huge pages, possibly memory
// compaction) that measured as much as a whole 512^3 product. Slots 0-1 serve gemm_blocked,
// 2-3 the calling thread of gemm_team.
template <class T> T* pack_buffer(int which, size_t count) {
  struct Buf {
    T* p = nullptr;
    size_t n = 0;
    ~Buf() { aligned_free(p); }
  };
  thread_local Buf bufs[4];
  Buf& b = bufs[which];
  if (b.n < count) {
    aligned_free(b.p);
    b.p = static_cast<T*>(aligned_alloc_bytes(count * sizeof(T)));
    if (!b.p) throw std::bad_alloc();
    b.n = count;
  }
  return b.p;
}

// C tiles of rows [0, mc) x columns [j0, j1) of the current (ic, jc) block from packed A
// (mc x kc) and packed B (kc x nc): one A micro-panel stays in L1 while the loop sweeps the
// B panels, which stream from L2. `first` (the first kc block) overwrites C, later ones add.
template <class T>
void macro_kernel(int64_t mc, int64_t kc, int64_t j0, int64_t j1, const T* pa, const T* pb,
                  T* c, int64_t ldc, bool first) {
  constexpr int MR = Config<T>::MR, NR = Config<T>::NR;
  alignas(64) T edge[MR * NR];
  for (int64_t ir = 0; ir < mc; ir += MR) {
    const int64_t mr = std::min<int64_t>(MR, mc - ir);
    for (int64_t jr = j0; jr < j1; jr += NR) {
      const int64_t nr = std::min<int64_t>(NR, j1 - jr);
      T* ct = c + ir * ldc + jr;
      if (mr == MR && nr == NR) {
        micro_kernel(kc, pa + ir * kc, pb + jr * kc, ct, ldc, first);
        continue;
      }
      micro_kernel(kc, pa + ir * kc, pb + jr * kc, edge, NR, true);
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t j = 0; j < nr; ++j)
          ct[r * ldc + j] = first ? edge[r * NR + j] : ct[r * ldc + j] + edge[r * NR + j];
    }
  }
}

template <class T> void zero_rows(T* c, int64_t m, int64_t p, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + p, T(0));
}

// The blocked loops on one thread: C (m x p, ldc) = A . B.
template <class T, class SA, class SB>
void gemm_blocked(int64_t m, int64_t n, int64_t p, const SA* a, int64_t ars, int64_t acs,
                  const SB* b, int64_t brs, int64_t bcs, T* c, int64_t ldc) {
  using Cfg = Config<T>;
  constexpr int MR = Cfg::MR;
  if (n == 0) return zero_rows(c, m, p, ldc);
  T* pa = pack_buffer<T>(0, (size_t)std::min(m + MR, Cfg::MB) * Cfg::KC);
  T* pb = pack_buffer<T>(1, (size_t)Cfg::KC * (Cfg::NC + Cfg::NR));
  for (int64_t pc = 0; pc < n; pc += Cfg::KC) {
    const int64_t kc = std::min(Cfg::KC, n - pc);
    for (int64_t ib = 0; ib < m; ib += Cfg::MB) {
      const int64_t mb = std::min(Cfg::MB, m - ib);
      for (int64_t q = 0; q * MR < mb; ++q) pack_a(pa, a + ib * ars + pc * acs, ars, acs, mb, kc, q);
      for (int64_t jc = 0; jc < p; jc += Cfg::NC) {
        const int64_t nc = std::min(Cfg::NC, p - jc);
        pack_b(pb, b + pc * brs + jc * bcs, brs, bcs, kc, nc);
        macro_kernel(mb, kc, 0, nc, pa, pb, c + ib * ldc + jc, ldc, pc == 0);
      }
    }
  }
}

// One matrix on all threads, the same loops with each stage shared: the A panels of a slab,
// then the B panels of a block, then (row group, column range) tiles of C, each handed out
// dynamically so that a thread the OS preempts delays one item rather than half the product.
template <class T, class SA, class SB>
void gemm_team(int nt, int64_t m, int64_t n, int64_t p, const SA* a, int64_t ars, int64_t acs,
               const SB* b, int64_t brs, int64_t bcs, T* c, int64_t ldc) {
  using Cfg = Config<T>;
  constexpr int MR = Cfg::MR, NR = Cfg::NR;
  if (n == 0) return zero_rows(c, m, p, ldc);
  T* const pa = pack_buffer<T>(2, (size_t)std::min(m + MR, Cfg::MB) * Cfg::KC);
  T* const pb = pack_buffer<T>(3, (size_t)Cfg::KC * (Cfg::NC + NR));
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
  for (int64_t pc = 0; pc < n; pc += Cfg::KC) {
    const int64_t kc = std::min(Cfg::KC, n - pc);
    for (int64_t ib = 0; ib < m; ib += Cfg::MB) {
      const int64_t mb = std::min(Cfg::MB, m - ib);
      const int64_t a_panels = (mb + MR - 1) / MR;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 4)
#endif
      for (int64_t q = 0; q < a_panels; ++q) pack_a(pa, a + ib * ars + pc * acs, ars, acs, mb, kc, q);
      const int64_t row_groups = (mb + Cfg::MC - 1) / Cfg::MC;
      for (int64_t jc = 0; jc < p; jc += Cfg::NC) {
        const int64_t nc = std::min(Cfg::NC, p - jc);
        const int64_t b_panels = (nc + NR - 1) / NR;
        const int64_t col_groups =
            std::min(b_panels, std::max<int64_t>(1, (8 * nt + row_groups - 1) / row_groups));
        const int64_t per_group = (b_panels + col_groups - 1) / col_groups * NR;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t q = 0; q < b_panels; ++q)
          pack_b(pb + q * NR * kc, b + pc * brs + (jc + q * NR) * bcs, brs, bcs, kc,
                 std::min<int64_t>(NR, nc - q * NR));
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t it = 0; it < row_groups * col_groups; ++it) {
          const int64_t i0 = it / col_groups * Cfg::MC, j0 = it % col_groups * per_group;
          if (j0 >= nc) continue;
          macro_kernel(std::min(Cfg::MC, mb - i0), kc, j0, std::min(nc, j0 + per_group),
                       pa + i0 * kc, pb, c + (ib + i0) * ldc + jc, ldc, pc == 0);
        }
      }
    }
  }
}

// acc[0..p) += a[k0..k1) . B[k0..k1, 0..p) for B with contiguous rows: four rows per pass so
// the accumulator row (in L1) is read and written a quarter as often.
template <class S, class T>
void gemv_rows(const S* a, const S* b, int64_t brs, int64_t k0, int64_t k1, int64_t p, T* acc) {
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const T a0 = widen<T>(a[k]), a1 = widen<T>(a[k + 1]), a2 = widen<T>(a[k + 2]),
            a3 = widen<T>(a[k + 3]);
    const S *r0 = b + k * brs, *r1 = r0 + brs, *r2 = r1 + brs, *r3 = r2 + brs;
#pragma omp simd
    for (int64_t j = 0; j < p; ++j)
      acc[j] += a0 * widen<T>(r0[j]) + a1 * widen<T>(r1[j]) + a2 * widen<T>(r2[j]) +
                a3 * widen<T>(r3[j]);
  }
  for (; k < k1; ++k) {
    const T ak = widen<T>(a[k]);
    const S* r = b + k * brs;
#pragma omp simd
    for (int64_t j = 0; j < p; ++j) acc[j] += ak * widen<T>(r[j]);
  }
}

struct MatmulArgs {
  int64_t m, n, p, batch, stride_a, stride_b;
  bool ta, tb;
};

constexpr int64_t kFewRows = 64;  // dot products beat packing up to here (cpu_notes.md)

template <class S> void matmul_kernel(const void* a_, const void* b_, void* out_,
                                      const MatmulArgs& g) {
  using T = gemm_t<S>;
  constexpr bool direct = std::is_same_v<T, S> || sizeof(T) == sizeof(S);  // C written in place
  const S* a = (const S*)a_;
  const S* b = (const S*)b_;
  S* out = (S*)out_;
  const int64_t m = g.m, n = g.n, p = g.p;
  const int64_t ars = g.ta ? 1 : n, acs = g.ta ? m : 1;
  const int64_t brs = g.tb ? 1 : p, bcs = g.tb ? n : 1;
  const int nt = max_threads();

  // A few rows times a transposed B (decoding one or a batch of sequences: x @ W.T): dot
  // products (dot_block, matmul.h), columns split across threads, B streamed once and never
  // packed. Packing a (2560, 2048) weight for the GEMM costs ~5 ms, 27x one row's product.
  if (g.tb && !g.ta && m <= kFewRows) {
    const int64_t width = std::max<int64_t>(64, (p + 4 * nt - 1) / (4 * nt));
    const int64_t blocks = (p + width - 1) / width;
    std::vector<T> res((size_t)g.batch * m * p);
    parallel_items(g.batch * blocks, width * n * m, [&](int64_t it) {
      const int64_t bi = it / blocks, j0 = it % blocks * width, j1 = std::min(p, j0 + width);
      dot_block<S, T>(a + bi * g.stride_a, m, b + bi * g.stride_b + j0 * n, j1 - j0, n,
                      res.data() + bi * m * p + j0, p);
    });
    for (int64_t i = 0; i < g.batch * m * p; ++i) out[i] = store<S>(res[i]);
    return;
  }
  if (m == 1) {  // matrix-vector (decoding) with B's rows contiguous: B is streamed once
    // rows of B split across threads (each streams a contiguous band), partial sums added
    const int64_t band = std::max<int64_t>(16, (n + 2 * nt - 1) / (2 * nt));
    const int64_t bands = std::max<int64_t>(1, (n + band - 1) / band);
    std::vector<T> part((size_t)g.batch * bands * p, T(0));
    parallel_items(g.batch * bands, band * p, [&](int64_t it) {
      const int64_t bi = it / bands, k0 = it % bands * band;
      gemv_rows(a + bi * g.stride_a, b + bi * g.stride_b, brs, k0, std::min(n, k0 + band), p,
                part.data() + it * p);
    });
    for (int64_t bi = 0; bi < g.batch; ++bi)
      for (int64_t j = 0; j < p; ++j) {
        T s = 0;
        for (int64_t q = 0; q < bands; ++q) s += part[(bi * bands + q) * p + j];
        out[bi * p + j] = store<S>(s);
      }
    return;
  }

  // Many or small matrices: one matrix per work item. Few large ones: a team on each, of one
  // thread per kTeamFlops of work at most: waking a sleeping thread (the passive wait policy,
  // threads.py) costs about as much as a few hundred thousand flops, and on a busy machine
  // every thread of the team may be the one the OS has descheduled.
  constexpr double kTeamFlops = 4e6;
  const double flops = 2.0 * (double)m * (double)n * (double)p;
  const int team_nt = (int)std::min<double>(nt, std::floor(flops / kTeamFlops));
  const bool per_matrix = team_nt < 2 || g.batch >= 2 * nt;
  auto one = [&](int64_t bi, bool team) {
    const S* ab = a + bi * g.stride_a;
    const S* bb = b + bi * g.stride_b;
    S* ob = out + bi * m * p;
    auto run = [&](gemm_t<S>* c) {
      if (team) gemm_team<T>(team_nt, m, n, p, ab, ars, acs, bb, brs, bcs, c, p);
      else gemm_blocked<T>(m, n, p, ab, ars, acs, bb, brs, bcs, c, p);
    };
    if constexpr (direct) {
      run((T*)ob);
    } else {  // fp16/bf16: accumulate in fp32, round once
      Scratch<T> tmp((size_t)m * p);
      run(tmp.p);
      auto round = [&](int64_t lo, int64_t hi) {
#pragma omp simd
        for (int64_t i = lo; i < hi; ++i) ob[i] = store<S>(tmp.p[i]);
      };
      if (team) parallel_for(m * p, int64_t(1) << 16, round);
      else round(0, m * p);
    }
  };
  if (per_matrix) {
    parallel_items(g.batch, (int64_t)std::min(flops, 1e9), [&](int64_t bi) { one(bi, false); });
  } else {
    for (int64_t bi = 0; bi < g.batch; ++bi) one(bi, true);
  }
}

using MatmulFn = void (*)(const void*, const void*, void*, const MatmulArgs&);

const KernelTable<MatmulFn> kMatmul("matmul", [](auto tag) -> MatmulFn {
  using S = typename decltype(tag)::type;
  if constexpr (std::is_same_v<S, b8>) return nullptr;
  else return &matmul_kernel<S>;
});

void matmul(const Array& a, const Array& b, Array& out, int64_t m, int64_t n, int64_t p,
            int64_t batch, std::optional<int64_t> stride_a, std::optional<int64_t> stride_b,
            bool transpose_a, bool transpose_b) {
  if (m < 0 || n < 0 || p < 0 || batch < 0)
    raise("ShapeError", "matmul: sizes must be >= 0");
  check_same_dtype(a, b, "matmul");
  check_dtype(out, a.dtype, "matmul", "out");
  const MatmulArgs g{m, n, p, batch, stride_a.value_or(m * n), stride_b.value_or(n * p),
                     transpose_a, transpose_b};
  if (g.stride_a < 0 || g.stride_b < 0) raise("ShapeError", "matmul: batch strides must be >= 0");
  check_size(out, batch * m * p, "matmul", "out");
  auto check_span = [&](const Array& x, int64_t stride, int64_t count, const char* what) {
    if (batch > 0 && count > 0 && (batch - 1) * stride + count > x.size)
      raise("ShapeError", std::string("matmul: ") + what + " needs " +
                              std::to_string((batch - 1) * stride + count) +
                              " elements, its buffer has " + std::to_string(x.size));
  };
  check_span(a, g.stride_a, m * n, "a");
  check_span(b, g.stride_b, n * p, "b");
  const MatmulFn fn = kMatmul[a.dtype];
  if (out.size == 0) return;
  without_gil([&] { fn(a.data, b.data, out.data, g); });
}

}  // namespace

template <class T>
void gemm_serial(int64_t m, int64_t n, int64_t p, const T* a, int64_t ars, int64_t acs,
                 const T* b, int64_t brs, int64_t bcs, T* c, int64_t ldc) {
  gemm_blocked<T>(m, n, p, a, ars, acs, b, brs, bcs, c, ldc);
}
template void gemm_serial<float>(int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                                 const float*, int64_t, int64_t, float*, int64_t);
template void gemm_serial<double>(int64_t, int64_t, int64_t, const double*, int64_t, int64_t,
                                  const double*, int64_t, int64_t, double*, int64_t);

void matmul_nt(DType dt, const void* a, const void* b, void* out, int64_t m, int64_t n,
               int64_t p) {
  const MatmulArgs g{m, n, p, 1, m * n, n * p, false, true};
  kMatmul[dt](a, b, out, g);  // float dtypes always have a kernel: nothing is raised here
}

void bind_matmul(nb::module_& m) {
  m.def("matmul", &matmul, nb::arg("a"), nb::arg("b"), nb::arg("out"), nb::arg("m"),
        nb::arg("n"), nb::arg("p"), nb::kw_only(), nb::arg("batch") = 1,
        nb::arg("stride_a") = nb::none(), nb::arg("stride_b") = nb::none(),
        nb::arg("transpose_a") = false, nb::arg("transpose_b") = false,
        "out[i] = A[i] @ B[i] for i < batch (see numpy_ref.matmul for the layout).");
}

}  // namespace needle
