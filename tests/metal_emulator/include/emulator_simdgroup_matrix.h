// simdgroup_matrix for the MSL emulator's metal_stdlib (included there, inside nothing; it
// opens msl::metal itself): 8x8 matrices spread over the lanes of a simd-group.
#pragma once

namespace msl {
namespace metal {

// ---- simdgroup matrices ----------------------------------------------------------------------
// As on Apple GPUs, a simdgroup_matrix is spread over the 32 lanes of its simd-group: lane l
// holds elements l*K .. l*K+K-1 (row-major, K = Rows*Cols/32: two of an 8x8), so a thread's
// registers (and the emulator's stack frames, which the pipeline thread limit is derived from)
// hold its share only. Which lane holds which element is the emulator's choice (Apple's layout,
// seen through thread_elements(), is not modelled and the kernels do not use it). Loads and
// stores are each lane's own accesses; a product exchanges the fragments of its operands
// between the lanes, so every lane of the simd-group must execute it, as MSL requires.

namespace detail {

// The row-major index of element i of this lane's fragment.
template <int Cols, int Rows>
inline uint32_t fragment_index(int i) {
  return emu::current_lane() * uint32_t(Rows * Cols / 32) + uint32_t(i);
}

}  // namespace detail

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Rows * Cols % 32 == 0, "a simdgroup_matrix spreads over 32 lanes");
  static constexpr int kPerLane = Rows * Cols / 32;
  T e[kPerLane];  // this lane's elements
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal) {
    for (int i = 0; i < kPerLane; ++i) {
      const uint32_t x = detail::fragment_index<Cols, Rows>(i);
      e[i] = x / Cols == x % Cols ? diagonal : T(0);
    }
  }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  for (int i = 0; i < m.kPerLane; ++i) m.e[i] = value;
  return m;
}

namespace detail {

template <class T, int Cols, int Rows>
inline void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src,
                           ulong elements_per_row, ulong2 origin, bool transpose) {
  src += origin.y * elements_per_row + origin.x;
  for (int i = 0; i < d.kPerLane; ++i) {
    const ulong x = fragment_index<Cols, Rows>(i), r = x / Cols, c = x % Cols;
    d.e[i] = transpose ? src[c * elements_per_row + r] : src[r * elements_per_row + c];
  }
}

template <class T, int Cols, int Rows>
inline void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& m, T* dst,
                            ulong elements_per_row, ulong2 origin, bool transpose) {
  dst += origin.y * elements_per_row + origin.x;
  for (int i = 0; i < m.kPerLane; ++i) {
    const ulong x = fragment_index<Cols, Rows>(i), r = x / Cols, c = x % Cols;
    (transpose ? dst[c * elements_per_row + r] : dst[r * elements_per_row + c]) = m.e[i];
  }
}

}  // namespace detail

// MSL loads and stores simdgroup matrices from device and threadgroup memory only.
#define NEEDLE_EMU_SIMDGROUP_IO(AS)                                                           \
  template <class T, int Cols, int Rows>                                                      \
  inline void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const AS T* src,             \
                             ulong elements_per_row = Cols, ulong2 origin = 0,                \
                             bool transpose = false) {                                        \
    detail::simdgroup_load(d, (const T*)src, elements_per_row, origin, transpose);            \
  }                                                                                           \
  template <class T, int Cols, int Rows>                                                      \
  inline void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& m, AS T* dst,            \
                              ulong elements_per_row = Cols, ulong2 origin = 0,               \
                              bool transpose = false) {                                       \
    detail::simdgroup_store(m, (T*)dst, elements_per_row, origin, transpose);                 \
  }
NEEDLE_EMU_SIMDGROUP_IO(NEEDLE_EMU_DEVICE)
NEEDLE_EMU_SIMDGROUP_IO(NEEDLE_EMU_THREADGROUP)
#undef NEEDLE_EMU_SIMDGROUP_IO

namespace detail {

template <class T, int K>
struct Fragments {
  T m[3][K];  // a lane's elements of a, b and c
};

}  // namespace detail

// d = a * b + c: the lanes exchange their fragments of a, b and c, then each computes its own
// elements of d (in float, rounded once to T). Out of line and without the access hooks: its
// operands are the thread's own matrices and the emulator's exchange slots, never device or
// threadgroup memory, and it runs for every lane of every product.
template <class T, int N>
__attribute__((noinline, no_sanitize("coverage"))) void simdgroup_multiply_accumulate(
    simdgroup_matrix<T, N, N>& d, const simdgroup_matrix<T, N, N>& a,
    const simdgroup_matrix<T, N, N>& b, const simdgroup_matrix<T, N, N>& c) {
  constexpr int K = simdgroup_matrix<T, N, N>::kPerLane;
  detail::Fragments<T, K> mine;
  for (int i = 0; i < K; ++i) {
    mine.m[0][i] = a.e[i];
    mine.m[1][i] = b.e[i];
    mine.m[2][i] = c.e[i];
  }
  uint32_t mask;
  auto slots = emu::simd_exchange(mine, mask);
  if (mask != 0xffffffffu) {
    emu::report_partial_simdgroup("simdgroup_multiply_accumulate");
    return;
  }
  // element x of operand op (0: a, 1: b, 2: c), from the slot of the lane holding it
  auto elem = [slots](int op, uint32_t x) {
    T v;
    std::memcpy(&v, slots[x / K] + sizeof(T) * (op * K + x % K), sizeof(T));
    return float(v);
  };
  const uint32_t lane = emu::current_lane();
  for (int i = 0; i < K; ++i) {
    const uint32_t x = lane * K + uint32_t(i), r = x / N, col = x % N;
    float acc = elem(2, x);
    for (uint32_t k = 0; k < uint32_t(N); ++k) acc += elem(0, r * N + k) * elem(1, k * N + col);
    d.e[i] = T(acc);
  }
}

template <class T, int N>
inline void simdgroup_multiply(simdgroup_matrix<T, N, N>& d, const simdgroup_matrix<T, N, N>& a,
                               const simdgroup_matrix<T, N, N>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, N, N>(T(0)));
}

}  // namespace metal
}  // namespace msl
