// Matrix multiplication: a GotoBLAS-style blocked GEMM around a register-tiled micro-kernel
// written with GCC/Clang vector extensions (AVX-512, AVX2, SSE or NEON, whichever the build
// targets), plus a matrix-vector path for m == 1 (decoding one token).
//
// Blocking: B is packed into KC x NR panels (a KC x NC block, sized for L2) and A into
// MR x KC panels (one panel stays in L1 while the micro-kernel sweeps the B panels). The
// micro-kernel keeps an MR x NR tile of C in registers. fp16/bf16 are widened to fp32 while
// packing and rounded once when C is stored; integers multiply in unsigned arithmetic (wrapping
// as numpy's). Threads take independent tiles of C (and matrices of a batch).
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
// one broadcast of A must fit the register file.
template <class T> struct Config {
  static constexpr int L = kVecBytes / (int)sizeof(T);
#ifdef TUNE_MR
  static constexpr int MR = TUNE_MR;
  static constexpr int NV = TUNE_NV;
  static constexpr int NR = NV * L;
  static constexpr int64_t KC = TUNE_KC;
  static constexpr int64_t MC = TUNE_MC;
  static constexpr int64_t NC = TUNE_NC * 4 / (int64_t)sizeof(T) / NR * NR;
#else
  static constexpr int MR = kRegs == 32 ? 6 : 6;
  static constexpr int NV = kRegs == 32 ? 4 : 2;
  static constexpr int NR = NV * L;
  static constexpr int64_t KC = 256;
  static constexpr int64_t MC = 96;
  static constexpr int64_t NC = 1024 * 4 / (int64_t)sizeof(T) / NR * NR;
#endif
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

template <class T, class S> inline T widen(S x) {
  if constexpr (std::is_integral_v<T>) return (T)x;
  else return (T)load(x);
}

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

// Pack rows [0, mc) x cols [0, kc) of A (A(i,k) = a[i*ars + k*acs]) into MR-row panels, each
// stored k-major (kc x MR), zero-padded to a multiple of MR rows.
template <class T, class S>
void pack_a(T* __restrict dst, const S* a, int64_t ars, int64_t acs, int64_t mc, int64_t kc) {
  constexpr int MR = Config<T>::MR;
  for (int64_t ip = 0; ip < mc; ip += MR) {
    const int rows = (int)std::min<int64_t>(MR, mc - ip);
    T* d = dst + ip * kc;
    if (acs == 1) {
      for (int r = 0; r < rows; ++r) {
        const S* src = a + (ip + r) * ars;
        for (int64_t k = 0; k < kc; ++k) d[k * MR + r] = widen<T>(src[k]);
      }
    } else {
      for (int64_t k = 0; k < kc; ++k) {
        const S* src = a + k * acs + ip * ars;
        for (int r = 0; r < rows; ++r) d[k * MR + r] = widen<T>(src[r * ars]);
      }
    }
    for (int r = rows; r < MR; ++r)
      for (int64_t k = 0; k < kc; ++k) d[k * MR + r] = T(0);
  }
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
    } else {
      for (int j = 0; j < cols; ++j) {
        const S* src = b + (jp + j) * bcs;
        for (int64_t k = 0; k < kc; ++k) d[k * NR + j] = widen<T>(src[k * brs]);
      }
      for (int j = cols; j < NR; ++j)
        for (int64_t k = 0; k < kc; ++k) d[k * NR + j] = T(0);
    }
  }
}

// Per-thread packing buffers, grown on demand and reused across calls.
template <class T> T* pack_buffer(int which, size_t count) {
  struct Buf {
    T* p = nullptr;
    size_t n = 0;
    ~Buf() { aligned_free(p); }
  };
  thread_local Buf bufs[2];
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
  if (n == 0) return zero_rows(c, m, p, ldc);
  T* pa = pack_buffer<T>(0, (size_t)Cfg::MC * Cfg::KC);
  T* pb = pack_buffer<T>(1, (size_t)Cfg::KC * (Cfg::NC + Cfg::NR));
  for (int64_t jc = 0; jc < p; jc += Cfg::NC) {
    const int64_t nc = std::min(Cfg::NC, p - jc);
    for (int64_t pc = 0; pc < n; pc += Cfg::KC) {
      const int64_t kc = std::min(Cfg::KC, n - pc);
      pack_b(pb, b + pc * brs + jc * bcs, brs, bcs, kc, nc);
      for (int64_t ic = 0; ic < m; ic += Cfg::MC) {
        const int64_t mc = std::min(Cfg::MC, m - ic);
        pack_a(pa, a + ic * ars + pc * acs, ars, acs, mc, kc);
        macro_kernel(mc, kc, 0, nc, pa, pb, c + ic * ldc + jc, ldc, pc == 0);
      }
    }
  }
}

// One matrix on all threads: each KC x NC block of B is packed once, cooperatively, and the
// (row block, column range) items that use it are handed out dynamically, so a preempted
// thread costs one item rather than half the product. Re-packing a row block of A for each
// of its column ranges is cheap: every packed A element is used nc / groups times.
template <class T, class SA, class SB>
void gemm_team(int64_t m, int64_t n, int64_t p, const SA* a, int64_t ars, int64_t acs,
               const SB* b, int64_t brs, int64_t bcs, T* c, int64_t ldc) {
  using Cfg = Config<T>;
  constexpr int NR = Config<T>::NR;
  if (n == 0) return zero_rows(c, m, p, ldc);
  const int nt = max_threads();
  Scratch<T> pb((size_t)Cfg::KC * (Cfg::NC + NR));
  Scratch<T> pas((size_t)nt * Cfg::MC * Cfg::KC);
  const int64_t ic_blocks = (m + Cfg::MC - 1) / Cfg::MC;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
  {
#ifdef _OPENMP
    T* pa = pas.p + (size_t)omp_get_thread_num() * Cfg::MC * Cfg::KC;
#else
    T* pa = pas.p;
#endif
    for (int64_t jc = 0; jc < p; jc += Cfg::NC) {
      const int64_t nc = std::min(Cfg::NC, p - jc);
      const int64_t panels = (nc + NR - 1) / NR;
      const int64_t groups = std::min(panels, std::max<int64_t>(1, (8 * nt + ic_blocks - 1) / ic_blocks));
      const int64_t per_group = (panels + groups - 1) / groups * NR;
      for (int64_t pc = 0; pc < n; pc += Cfg::KC) {
        const int64_t kc = std::min(Cfg::KC, n - pc);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t q = 0; q < panels; ++q)
          pack_b(pb.p + q * NR * kc, b + pc * brs + (jc + q * NR) * bcs, brs, bcs, kc,
                 std::min<int64_t>(NR, nc - q * NR));
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t it = 0; it < ic_blocks * groups; ++it) {
          const int64_t ic = it / groups * Cfg::MC, mc = std::min(Cfg::MC, m - ic);
          const int64_t j0 = it % groups * per_group;
          if (j0 >= nc) continue;
          pack_a(pa, a + ic * ars + pc * acs, ars, acs, mc, kc);
          macro_kernel(mc, kc, j0, std::min(nc, j0 + per_group), pa, pb.p, c + ic * ldc + jc,
                       ldc, pc == 0);
        }
      }
    }
  }
}

// out (1 x p) = a (1 x n) . B for one matrix, columns [j0, j1): the decode path. Streams B
// once; no packing.
template <class S>
void gemv_columns(const S* a, const S* b, int64_t brs, int64_t bcs, int64_t n, int64_t j0,
                  int64_t j1, gemm_t<S>* out) {
  using T = gemm_t<S>;
  if (bcs == 1) {  // rows of B are contiguous: out += a[k] * B[k, :]
    for (int64_t j = j0; j < j1; ++j) out[j] = T(0);
    for (int64_t k = 0; k < n; ++k) {
      const T ak = widen<T>(a[k]);
      const S* row = b + k * brs;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) out[j] += ak * widen<T>(row[j]);
    }
  } else {  // columns of B are contiguous (transposed): dot products
    for (int64_t j = j0; j < j1; ++j) {
      const S* col = b + j * bcs;
      constexpr int U = 16;
      T lanes[U] = {};
      int64_t k = 0;
      for (; k + U <= n; k += U)
        for (int u = 0; u < U; ++u) lanes[u] += widen<T>(a[k + u]) * widen<T>(col[(k + u) * brs]);
      T s = 0;
      for (; k < n; ++k) s += widen<T>(a[k]) * widen<T>(col[k * brs]);
      for (int u = 0; u < U; ++u) s += lanes[u];
      out[j] = s;
    }
  }
}

struct MatmulArgs {
  int64_t m, n, p, batch, stride_a, stride_b;
  bool ta, tb;
};

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

  if (m == 1) {  // matrix-vector: split the columns of every matrix across threads
    const int64_t width = std::max<int64_t>(256, (p + nt - 1) / nt);
    const int64_t blocks = (p + width - 1) / width;
    parallel_items(g.batch * blocks, width * n, [&](int64_t it) {
      const int64_t bi = it / blocks, j0 = it % blocks * width, j1 = std::min(p, j0 + width);
      const S* ab = a + bi * g.stride_a;
      const S* bb = b + bi * g.stride_b;
      S* ob = out + bi * p;
      if constexpr (direct) {
        gemv_columns(ab, bb, brs, bcs, n, j0, j1, (T*)ob);
      } else {
        std::vector<T> tmp(j1);
        gemv_columns(ab, bb, brs, bcs, n, j0, j1, tmp.data());
        for (int64_t j = j0; j < j1; ++j) ob[j] = store<S>(tmp[j]);
      }
    });
    return;
  }

  // Many or small matrices: one matrix per work item. Few large ones: all threads on each.
  const double flops = 2.0 * (double)m * (double)n * (double)p;
  const bool per_matrix = nt == 1 || g.batch >= 2 * nt || flops < 4e6;
  auto one = [&](int64_t bi, bool team) {
    const S* ab = a + bi * g.stride_a;
    const S* bb = b + bi * g.stride_b;
    S* ob = out + bi * m * p;
    auto run = [&](gemm_t<S>* c) {
      if (team) gemm_team<T>(m, n, p, ab, ars, acs, bb, brs, bcs, c, p);
      else gemm_blocked<T>(m, n, p, ab, ars, acs, bb, brs, bcs, c, p);
    };
    if constexpr (direct) {
      run((T*)ob);
    } else {  // fp16/bf16: accumulate in fp32, round once
      Scratch<T> tmp((size_t)m * p);
      run(tmp.p);
      for (int64_t i = 0; i < m * p; ++i) ob[i] = store<S>(tmp.p[i]);
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

void bind_matmul(nb::module_& m) {
  m.def("matmul", &matmul, nb::arg("a"), nb::arg("b"), nb::arg("out"), nb::arg("m"),
        nb::arg("n"), nb::arg("p"), nb::kw_only(), nb::arg("batch") = 1,
        nb::arg("stride_a") = nb::none(), nb::arg("stride_b") = nb::none(),
        nb::arg("transpose_a") = false, nb::arg("transpose_b") = false,
        "out[i] = A[i] @ B[i] for i < batch (see numpy_ref.matmul for the layout).");
}

}  // namespace needle
