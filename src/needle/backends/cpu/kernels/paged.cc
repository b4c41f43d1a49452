// Paged attention (capability paged_attention; numpy_ref/paged.py is the specification):
// paged_write stores keys and values in slots of a page pool, paged_attention runs causal
// grouped-query attention of many queries, each over its own sequence's pages.
#include <cmath>
#include <limits>
#include <vector>

#include "common.h"
#include "decode_heads.h"

namespace needle {
namespace {

struct PagedArgs {
  int64_t tokens, q_heads, kv_heads, head_dim, page_size, max_pages, num_pages;
  double scale;
  int64_t window;  // a sliding window (positions p - window + 1..p), 0: none
  double softcap;  // scores soft-capped (Gemma 2: common.h soft_cap), 0: none
};

using WriteFn = void (*)(const void*, const void*, const int32_t*, void*, void*, int64_t,
                         int64_t, int64_t);
using PagedFn = void (*)(const void*, const void*, const void*, const int32_t*,
                         const int32_t*, const int32_t*, void*, const PagedArgs&);

template <class S> void write_kernel(const void* k_, const void* v_, const int32_t* slots,
                                     void* kp_, void* vp_, int64_t tokens, int64_t row,
                                     int64_t num_slots) {
  const S* k = (const S*)k_;
  const S* v = (const S*)v_;
  S* kp = (S*)kp_;
  S* vp = (S*)vp_;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= num_slots) continue;  // padding
    std::copy(k + t * row, k + (t + 1) * row, kp + s * row);
    std::copy(v + t * row, v + (t + 1) * row, vp + s * row);
  }
}

// One query token's every head over positions lo..p (lo: 0, or the start of a sliding
// window): decode_heads for each KV head, with its query heads, row j of the window read
// from its page (a scalar online softmax a key, one 64-long dependent sum a head and key,
// took ~4x longer at 2,048 positions: docs/cpu_notes.md).
template <class S> void one_token(const S* q, const S* kp, const S* vp, const int32_t* table,
                                  int64_t p, S* out, const PagedArgs& g) {
  using C = std::conditional_t<std::is_same_v<S, double>, double, float>;
  const int64_t D = g.head_dim, G = g.q_heads / g.kv_heads, row = g.kv_heads * D;
  bool ok = p >= 0 && p / g.page_size < g.max_pages;
  for (int64_t j = 0; ok && j <= p / g.page_size; ++j)
    ok = table[j] >= 0 && table[j] < g.num_pages;
  if (!ok) {
    std::fill(out, out + g.q_heads * D, store<S>(std::numeric_limits<C>::quiet_NaN()));
    return;
  }
  // where row j of the window (position lo + j) starts in the pool, found once for every
  // KV head and both passes (a division by the page size a lookup)
  const int64_t lo = window_start(p, g.window), n = p + 1 - lo;
  std::vector<int64_t> at((size_t)n);
  for (int64_t j = 0, page = lo / g.page_size, in = lo % g.page_size; j < n; ++j) {
    at[j] = ((int64_t)table[page] * g.page_size + in) * row;
    if (++in == g.page_size) in = 0, ++page;
  }
  std::vector<C> qf(G * D);
  for (int64_t kh = 0; kh < g.kv_heads; ++kh) {
    for (int64_t i = 0; i < G * D; ++i) qf[i] = load(q[kh * G * D + i]);
    decode_heads<S, C>(qf.data(), n, D, G, (C)g.scale, g.softcap,
                       [&](int64_t j) { return kp + at[j] + kh * D; },
                       [&](int64_t j) { return vp + at[j] + kh * D; }, out + kh * G * D);
  }
}

template <class S> void paged_kernel(const void* q_, const void* kp_, const void* vp_,
                                     const int32_t* tables, const int32_t* seq_of,
                                     const int32_t* positions, void* out_, const PagedArgs& g) {
  const S* q = (const S*)q_;
  S* out = (S*)out_;
  const int64_t per = g.q_heads * g.head_dim;
  parallel_items(g.tokens, per * 64, [&](int64_t t) {
    one_token<S>(q + t * per, (const S*)kp_, (const S*)vp_,
                 tables + (int64_t)seq_of[t] * g.max_pages, positions[t], out + t * per, g);
  });
}

#define NEEDLE_FLOAT_TABLE(Fn, name, kernel)                      \
  KernelTable<Fn>(name, [](auto tag) -> Fn {                      \
    using S = typename decltype(tag)::type;                       \
    if constexpr (is_float_storage_v<S>) return &kernel<S>;       \
    else return nullptr;                                          \
  })
const KernelTable<WriteFn> kWrite = NEEDLE_FLOAT_TABLE(WriteFn, "paged_write", write_kernel);
const KernelTable<PagedFn> kPaged = NEEDLE_FLOAT_TABLE(PagedFn, "paged_attention",
                                                       paged_kernel);
#undef NEEDLE_FLOAT_TABLE

void paged_write(const Array& k, const Array& v, const Array& slots, Array& key_pages,
                 Array& value_pages, int64_t tokens, int64_t row, int64_t num_slots) {
  if (tokens < 0 || row < 0 || num_slots < 0)
    raise("ShapeError", "paged_write: sizes must be >= 0");
  check_same_dtype(k, v, "paged_write");
  check_same_dtype(k, key_pages, "paged_write");
  check_same_dtype(k, value_pages, "paged_write");
  check_dtype(slots, DType::i32, "paged_write", "slots");
  check_size(k, tokens * row, "paged_write", "k");
  check_size(v, tokens * row, "paged_write", "v");
  check_size(slots, tokens, "paged_write", "slots");
  check_size(key_pages, num_slots * row, "paged_write", "key_pages");
  check_size(value_pages, num_slots * row, "paged_write", "value_pages");
  const WriteFn f = kWrite[k.dtype];
  without_gil([&] {
    f(k.data, v.data, slots.as<int32_t>(), key_pages.data, value_pages.data, tokens, row,
      num_slots);
  });
}

void paged_attention(const Array& q, const Array& key_pages, const Array& value_pages,
                     const Array& block_tables, const Array& seq_of, const Array& positions,
                     Array& out, int64_t tokens, int64_t q_heads, int64_t kv_heads,
                     int64_t head_dim, int64_t page_size, int64_t max_pages, int64_t num_pages,
                     double scale, int64_t window, double softcap) {
  if (tokens < 0 || head_dim < 0 || q_heads < 0 || kv_heads <= 0 || q_heads % kv_heads ||
      page_size <= 0 || max_pages <= 0 || num_pages < 0)
    raise("ShapeError", "paged_attention: need kv_heads > 0 dividing q_heads, page_size > 0 "
                        "and max_pages > 0");
  check_same_dtype(q, key_pages, "paged_attention");
  check_same_dtype(q, value_pages, "paged_attention");
  check_same_dtype(q, out, "paged_attention");
  for (const Array* a : {&block_tables, &seq_of, &positions})
    check_dtype(*a, DType::i32, "paged_attention", "an index array");
  const int64_t pool = num_pages * page_size * kv_heads * head_dim;
  check_size(q, tokens * q_heads * head_dim, "paged_attention", "q");
  check_size(out, q.size, "paged_attention", "out");
  check_size(key_pages, pool, "paged_attention", "key_pages");
  check_size(value_pages, pool, "paged_attention", "value_pages");
  check_size(seq_of, tokens, "paged_attention", "seq_of");
  check_size(positions, tokens, "paged_attention", "positions");
  if (block_tables.size % max_pages)
    raise("ShapeError", "paged_attention: block_tables must be (sequences, max_pages)");
  const int64_t seqs = block_tables.size / max_pages;
  for (int64_t t = 0; t < tokens; ++t)  // a bad row index would read outside the tables
    if (seq_of.as<int32_t>()[t] < 0 || seq_of.as<int32_t>()[t] >= seqs)
      raise("IndexOutOfRangeError", "paged_attention: seq_of holds a row outside the tables");
  const PagedFn f = kPaged[q.dtype];
  if (q.size == 0) return;
  if (window < 0) raise("ShapeError", "paged_attention: window must be >= 0");
  const PagedArgs g{tokens, q_heads, kv_heads, head_dim, page_size, max_pages, num_pages, scale,
                    window, softcap};
  without_gil([&] {
    f(q.data, key_pages.data, value_pages.data, block_tables.as<int32_t>(),
      seq_of.as<int32_t>(), positions.as<int32_t>(), out.data, g);
  });
}

}  // namespace

void bind_paged(nb::module_& m) {
  m.def("paged_write", &paged_write, nb::arg("k"), nb::arg("v"), nb::arg("slots"),
        nb::arg("key_pages"), nb::arg("value_pages"), nb::arg("tokens"), nb::arg("row"),
        nb::arg("num_slots"), "Store keys and values in page-pool slots; see numpy_ref.");
  m.def("paged_attention", &paged_attention, nb::arg("q"), nb::arg("key_pages"),
        nb::arg("value_pages"), nb::arg("block_tables"), nb::arg("seq_of"),
        nb::arg("positions"), nb::arg("out"), nb::arg("tokens"), nb::arg("q_heads"),
        nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("page_size"), nb::arg("max_pages"),
        nb::arg("num_pages"), nb::arg("scale"), nb::arg("window") = 0, nb::arg("softcap") = 0.0,
        "Causal attention of many queries over their sequences' pages; see numpy_ref.");
}

}  // namespace needle
