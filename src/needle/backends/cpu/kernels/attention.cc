// Attention kernels: attention with grouped-query heads (prefill through the blocked GEMM)
// and attention_decode (one token against a KV cache). fp16/bf16 compute in fp32 and round
// once on store.
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "common.h"
#include "decode_heads.h"
#include "matmul.h"
#include "rows.h"
#include "vmath.h"

namespace needle {
namespace {

// --- attention -------------------------------------------------------------------------------------

struct AttentionArgs {
  int64_t batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim;
  double scale;
  bool causal;
  int64_t window;  // with causal: a sliding window (keys position - window + 1..position), 0: none
  double softcap;  // scores soft-capped (Gemma 2: common.h soft_cap), 0: none
};

// One work item: query rows [i0, i0 + qb) of head (b, h). Scores and outputs go through the
// blocked GEMM (a tile of queries against all visible keys), so prefill runs at matmul speed;
// causal blocks stop at their last visible key, and with a sliding window start at the first
// key their earliest row sees (key0; each row's softmax then spans its own window).
template <class S> void attention_block(const S* q, const S* k, const S* v, S* out,
                                        const AttentionArgs& g, int64_t bh, int64_t i0,
                                        int64_t qb) {
  using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
  const int64_t D = g.head_dim, b = bh / g.q_heads, h = bh % g.q_heads;
  const int64_t kvh = h / (g.q_heads / g.kv_heads);
  const int64_t shift = g.kv_len - g.q_len;  // query i sits at position shift + i
  const bool windowed = g.causal && g.window > 0;
  const int64_t key0 = windowed ? std::max<int64_t>(0, shift + i0 - g.window + 1) : 0;
  // keys key0 .. key0 + visible - 1, the block's
  const int64_t visible = (g.causal ? std::min(g.kv_len, shift + i0 + qb) : g.kv_len) - key0;
  const S* qs = q + (bh * g.q_len + i0) * D;
  const S* ks = k + ((b * g.kv_heads + kvh) * g.kv_capacity + key0) * D;
  const S* vs = v + ((b * g.kv_heads + kvh) * g.kv_capacity + key0) * D;
  S* os = out + (bh * g.q_len + i0) * D;

  // fp16/bf16 inputs are widened once per block so the GEMM sees compute-type matrices.
  std::vector<C> widened;
  const C *qc, *kc, *vc;
  if constexpr (std::is_same_v<S, C>) {
    qc = qs;
    kc = ks;
    vc = vs;
  } else {
    widened.resize((size_t)(qb + 2 * visible) * D);
    C* w = widened.data();
    for (int64_t i = 0; i < qb * D; ++i) w[i] = load(qs[i]);
    for (int64_t i = 0; i < visible * D; ++i) w[qb * D + i] = load(ks[i]);
    for (int64_t i = 0; i < visible * D; ++i) w[(qb + visible) * D + i] = load(vs[i]);
    qc = w;
    kc = w + qb * D;
    vc = w + (qb + visible) * D;
  }
  std::vector<C> scores((size_t)qb * visible), o((size_t)qb * D);
  const C scale = (C)g.scale;
  if (qb == 1) {  // decode: dot products and a weighted sum, no packing
    for (int64_t j = 0; j < visible; ++j)
      scores[j] = lane_sum<C>(D, [&](int64_t d) { return qc[d] * kc[j * D + d]; });
  } else {
    gemm_serial<C>(qb, D, visible, qc, D, 1, kc, 1, D, scores.data(), visible);
  }
  for (int64_t i = 0; i < qb; ++i) {
    C* s = scores.data() + i * visible;
    // the row's keys: [lo, n) of the block's
    const int64_t n = g.causal ? std::min(visible, shift + i0 + i + 1 - key0) : visible;
    const int64_t lo = windowed ? std::max<int64_t>(0, shift + i0 + i - g.window + 1 - key0) : 0;
#pragma omp simd
    for (int64_t j = lo; j < n; ++j) s[j] = soft_cap(s[j] * scale, g.softcap);
    softmax_row(s + lo, n - lo);
    for (int64_t j = 0; j < lo; ++j) s[j] = 0;
    for (int64_t j = n; j < visible; ++j) s[j] = 0;
  }
  if (qb == 1) {
    for (int64_t j = 0; j < visible; ++j) {
      const C pj = scores[j];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += pj * vc[j * D + d];
    }
  } else {
    gemm_serial<C>(qb, visible, D, scores.data(), visible, 1, vc, D, 1, o.data(), D);
  }
  for (int64_t i = 0; i < qb * D; ++i) os[i] = store<S>(o[i]);
}

template <class S> void attention_kernel(const void* q, const void* k, const void* v, void* out,
                                         const AttentionArgs& g) {
  constexpr int64_t QB = 64;
  const int64_t blocks = (g.q_len + QB - 1) / QB;
  const int64_t items = g.batch * g.q_heads * blocks;
  parallel_items(items, g.kv_len * g.head_dim * std::min(QB, g.q_len), [&](int64_t it) {
    const int64_t bh = it / blocks, i0 = it % blocks * QB;
    attention_block<S>((const S*)q, (const S*)k, (const S*)v, (S*)out, g, bh, i0,
                       std::min(QB, g.q_len - i0));
  });
}

// --- attention_decode -------------------------------------------------------------------------

struct DecodeArgs {
  int64_t q_heads, kv_heads, head_dim, capacity, table_rows;
  double scale;
  int64_t window;  // a sliding window (positions p - window + 1..p), 0: none
  double softcap;  // scores soft-capped (Gemma 2: common.h soft_cap), 0: none
};

// One token's step (numpy_ref.attention_decode): rope the queries and the key with row p of
// the tables (rounded to S), store key and value at row p of the caches, then attention of
// every query head over rows lo..p of its KV head (lo: 0, or p - window + 1 with a sliding
// window). A position outside the cache or the tables writes nothing and gives NaN outputs.
template <class S> void attention_decode_kernel(const void* qkv_, const void* cos_,
                                                const void* sin_, int32_t p, void* keys_,
                                                void* values_, void* out_, const DecodeArgs& g) {
  using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
  const S* qkv = (const S*)qkv_;
  S* keys = (S*)keys_;
  S* values = (S*)values_;
  S* out = (S*)out_;
  const int64_t D = g.head_dim, H = D / 2;
  if (p < 0 || p >= std::min(g.capacity, g.table_rows)) {
    const S nan = store<S>(std::numeric_limits<C>::quiet_NaN());
    std::fill(out, out + g.q_heads * D, nan);
    return;
  }
  const S* cs = (const S*)cos_ + (int64_t)p * H;
  const S* sn = (const S*)sin_ + (int64_t)p * H;
  // RoPE of the queries (kept in the compute type after rounding) and of the keys (stored)
  const int64_t heads = g.q_heads + g.kv_heads;
  std::vector<C> q((size_t)(g.q_heads * D));
  for (int64_t h = 0; h < heads; ++h) {
    const S* x = qkv + h * D;
    S* krow = h < g.q_heads ? nullptr : keys + ((h - g.q_heads) * g.capacity + p) * D;
    for (int64_t i = 0; i < H; ++i) {
      const C a = load(x[i]), b = load(x[H + i]), c = load(cs[i]), s = load(sn[i]);
      const S lo = store<S>(a * c - b * s), hi = store<S>(b * c + a * s);
      if (krow) {
        krow[i] = lo;
        krow[H + i] = hi;
      } else {
        q[h * D + i] = load(lo);
        q[h * D + H + i] = load(hi);
      }
    }
  }
  for (int64_t h = 0; h < g.kv_heads; ++h)
    std::memcpy(values + (h * g.capacity + p) * D, qkv + (heads + h) * D, (size_t)D * sizeof(S));

  const int64_t lo = window_start(p, g.window);
  const int64_t n = (int64_t)p + 1 - lo, group = g.q_heads / g.kv_heads;
  // an item: a KV head and `per` of its query heads (all of them unless there are fewer KV
  // heads than threads), so that each block of keys and values is made float once for them
  const int64_t want = std::min<int64_t>(group, (max_threads() + g.kv_heads - 1) / g.kv_heads);
  const int64_t per = (group + want - 1) / want, parts = (group + per - 1) / per;  // none empty
  parallel_items(g.kv_heads * parts, n * D * 2 * per, [&](int64_t item) {
    const int64_t kvh = item / parts, h0 = kvh * group + item % parts * per;
    const int64_t heads_here = std::min(per, kvh * group + group - h0);
    const S* kc = keys + (kvh * g.capacity + lo) * D;  // rows lo.. of the KV head
    const S* vc = values + (kvh * g.capacity + lo) * D;
    decode_heads<S, C>(q.data() + h0 * D, n, D, heads_here, (C)g.scale, g.softcap,
                       [&](int64_t j) { return kc + j * D; },
                       [&](int64_t j) { return vc + j * D; }, out + h0 * D);
  });
}

// --- tables and bindings ------------------------------------------------------------------------

using AttnFn = void (*)(const void*, const void*, const void*, void*, const AttentionArgs&);
using DecodeFn = void (*)(const void*, const void*, const void*, int32_t, void*, void*, void*,
                          const DecodeArgs&);

const KernelTable<AttnFn> kAttention = NEEDLE_FLOAT_TABLE(AttnFn, "attention", attention_kernel);
const KernelTable<DecodeFn> kAttentionDecode =
    NEEDLE_FLOAT_TABLE(DecodeFn, "attention_decode", attention_decode_kernel);

void attention(const Array& q, const Array& k, const Array& v, Array& out, int64_t batch,
               int64_t q_heads, int64_t kv_heads, int64_t q_len, int64_t kv_len,
               int64_t kv_capacity, int64_t head_dim, double scale, bool causal,
               int64_t window, double softcap) {
  const AttentionArgs g{batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim,
                        scale, causal, window, softcap};
  if (batch < 0 || q_len < 0 || head_dim < 0 || q_heads < 0 || kv_heads <= 0 ||
      q_heads % kv_heads || kv_len < 1 || kv_len > kv_capacity || (causal && kv_len < q_len) ||
      window < 0)
    raise("ShapeError", "attention: need kv_heads > 0 dividing q_heads, 1 <= kv_len <= "
                        "kv_capacity, kv_len >= q_len when causal, and window >= 0");
  check_same_dtype(q, k, "attention");
  check_same_dtype(q, v, "attention");
  check_same_dtype(q, out, "attention");
  check_size(q, batch * q_heads * q_len * head_dim, "attention", "q");
  check_size(k, batch * kv_heads * kv_capacity * head_dim, "attention", "k");
  check_size(v, batch * kv_heads * kv_capacity * head_dim, "attention", "v");
  check_size(out, q.size, "attention", "out");
  const AttnFn f = kAttention[q.dtype];
  if (q.size == 0) return;
  without_gil([&] { f(q.data, k.data, v.data, out.data, g); });
}

void attention_decode(const Array& qkv, const Array& cos, const Array& sin,
                      const Array& position, Array& keys, Array& values, Array& out,
                      int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t capacity,
                      int64_t table_rows, double scale, int64_t window, double softcap) {
  const char* fn = "attention_decode";
  if (q_heads <= 0 || kv_heads <= 0 || q_heads % kv_heads || head_dim <= 0 || head_dim % 2 ||
      capacity < 0 || table_rows < 0 || window < 0)
    raise("ShapeError", "attention_decode: need kv_heads > 0 dividing q_heads > 0, an even "
                        "head_dim > 0 and capacity, table_rows, window >= 0");
  for (const Array* a : std::initializer_list<const Array*>{&cos, &sin, &keys, &values, &out})
    check_same_dtype(qkv, *a, fn);
  check_dtype(position, DType::i32, fn, "position");
  if (position.size < 1) raise("ShapeError", "attention_decode: position is empty");
  check_size(qkv, (q_heads + 2 * kv_heads) * head_dim, fn, "qkv");
  check_size(cos, table_rows * (head_dim / 2), fn, "cos");
  check_size(sin, table_rows * (head_dim / 2), fn, "sin");
  check_size(keys, kv_heads * capacity * head_dim, fn, "keys");
  check_size(values, kv_heads * capacity * head_dim, fn, "values");
  check_size(out, q_heads * head_dim, fn, "out");
  const DecodeFn f = kAttentionDecode[qkv.dtype];
  const DecodeArgs g{q_heads, kv_heads, head_dim, capacity, table_rows, scale, window,
                     softcap};
  const int32_t p = position.as<int32_t>()[0];
  without_gil([&] {
    f(qkv.data, cos.data, sin.data, p, keys.data, values.data, out.data, g);
  });
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def("attention_decode", &attention_decode, nb::arg("qkv"), nb::arg("cos"), nb::arg("sin"),
        nb::arg("position"), nb::arg("keys"), nb::arg("values"), nb::arg("out"),
        nb::arg("q_heads"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("capacity"),
        nb::arg("table_rows"), nb::arg("scale"), nb::arg("window"), nb::arg("softcap") = 0.0,
        "one decode step: rope q and k at position[0], store k and v in the caches, attend "
        "(within the last `window` positions when window > 0)");
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"),
        nb::arg("batch"), nb::arg("q_heads"), nb::arg("kv_heads"), nb::arg("q_len"),
        nb::arg("kv_len"), nb::arg("kv_capacity"), nb::arg("head_dim"), nb::arg("scale"),
        nb::arg("causal"), nb::arg("window") = 0, nb::arg("softcap") = 0.0);
}

}  // namespace needle
