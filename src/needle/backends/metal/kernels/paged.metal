// Paged attention (docs/kernels.md, "paged"; numpy_ref/paged.py is the specification).
// paged_write: one threadgroup per token copies its key and value rows into their pool slot.
// paged_attention: one threadgroup of 128 threads per (token, query head) walks positions
// 0..p in chunks of 128 through the block table: a thread per position scores q·k, the group
// reduces the chunk's max and sum of exp in threadgroup memory (online softmax), and threads
// over head_dim accumulate p·V, all in float.
#include <metal_stdlib>
using namespace metal;

struct PagedWriteParams {
  long tokens, row, num_slots;
};
struct PagedParams {
  long tokens, q_heads, kv_heads, head_dim, page_size, max_pages, num_pages;
  float scale;
  int window;     // a sliding window (positions p - window + 1..p), 0: none
  float softcap;  // scores soft-capped (Gemma 2: common.h soft_cap), 0: none
};

#define PAGED_ARGS                                                               \
  uint3 group [[threadgroup_position_in_grid]],                                  \
      uint3 tid [[thread_position_in_threadgroup]]

constant int PAGED_THREADS = 128;  // the launch's group size (gpu/paged.py)
constant int PAGED_MAX_D = 256;

template <class T>
kernel void paged_write(device const T* k [[buffer(0)]], device const T* v [[buffer(1)]],
                        device const int* slots [[buffer(2)]], device T* kp [[buffer(3)]],
                        device T* vp [[buffer(4)]], constant PagedWriteParams& p [[buffer(5)]],
                        PAGED_ARGS) {
  const long t = long(group.x), s = long(slots[t]);
  if (s < 0 || s >= p.num_slots) return;
  for (long i = long(tid.x); i < p.row; i += PAGED_THREADS) {
    kp[s * p.row + i] = k[t * p.row + i];
    vp[s * p.row + i] = v[t * p.row + i];
  }
}

// max (MAX) or sum of v over the group; every thread gets the result
template <bool MAX>
inline float paged_reduce(float v, threadgroup float* red, int t) {
  threadgroup_barrier(mem_flags::mem_threadgroup);  // red may still be read
  red[t] = v;
  for (int w = PAGED_THREADS / 2; w > 0; w /= 2) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (t < w) red[t] = MAX ? max(red[t], red[t + w]) : red[t] + red[t + w];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return red[0];
}

template <class T>
kernel void paged_attention(device const T* q [[buffer(0)]], device const T* kp [[buffer(1)]],
                            device const T* vp [[buffer(2)]],
                            device const int* tables [[buffer(3)]],
                            device const int* seq_of [[buffer(4)]],
                            device const int* positions [[buffer(5)]], device T* out [[buffer(6)]],
                            constant PagedParams& p [[buffer(7)]], PAGED_ARGS) {
  threadgroup float qs[PAGED_MAX_D];
  threadgroup float ps[PAGED_THREADS];
  threadgroup long slot_s[PAGED_THREADS];
  threadgroup float red[PAGED_THREADS];
  const long t = long(group.x), h = long(group.y), D = p.head_dim;
  const long kh = h / (p.q_heads / p.kv_heads), row = p.kv_heads * D;
  const int ti = int(tid.x);
  const long pos = long(positions[t]);
  device const int* table = tables + long(seq_of[t]) * p.max_pages;
  device T* o = out + (t * p.q_heads + h) * D;
  // every thread checks the position itself, then its share of the block table; one
  // reduction tells all (a shared flag written by whichever thread finds a bad page would be
  // written by several threads at once: a race, even when they write the same value)
  bool bad_here = pos < 0 || pos / p.page_size >= p.max_pages;
  if (!bad_here)
    for (long j = ti; j <= pos / p.page_size; j += PAGED_THREADS)
      if (table[j] < 0 || table[j] >= p.num_pages) bad_here = true;
  if (paged_reduce<true>(bad_here ? 1.0f : 0.0f, red, ti) != 0.0f) {
    // kernels cannot raise: NaN, as numpy_ref gives
    for (long i = ti; i < D; i += PAGED_THREADS) o[i] = store<T>(NAN);
    return;
  }
  for (long i = ti; i < D; i += PAGED_THREADS) qs[i] = load(q[(t * p.q_heads + h) * D + i]);
  float acc[PAGED_MAX_D / PAGED_THREADS] = {0.0f, 0.0f};
  float m = -INFINITY, l = 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const long lo = p.window > 0 && pos >= long(p.window) ? pos - long(p.window) + 1 : 0;
  for (long c0 = lo; c0 <= pos; c0 += PAGED_THREADS) {
    const long j = c0 + ti;
    float s = -INFINITY;
    if (j <= pos) {
      const long slot = long(table[j / p.page_size]) * p.page_size + j % p.page_size;
      device const T* kr = kp + slot * row + kh * D;
      float dot = 0.0f;
      for (long i = 0; i < D; i++) dot += qs[i] * float(load(kr[i]));
      s = soft_cap(dot * p.scale, p.softcap);
      slot_s[ti] = slot;
    }
    const float mn = paged_reduce<true>(max(s, m), red, ti);
    const float e = j <= pos ? exp(s - mn) : 0.0f;
    ps[ti] = e;
    const float corr = exp(m - mn);
    l = l * corr + paged_reduce<false>(e, red, ti);  // its barriers publish ps and slot_s
    m = mn;
    const int n = int(min(pos - c0 + 1, long(PAGED_THREADS)));
    for (int u = 0; u < PAGED_MAX_D / PAGED_THREADS; u++) {
      const long i = ti + u * PAGED_THREADS;
      if (i < D) {
        float a = acc[u] * corr;
        for (int r = 0; r < n; r++) a += ps[r] * float(load(vp[slot_s[r] * row + kh * D + i]));
        acc[u] = a;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // ps and slot_s are rewritten next
  }
  for (int u = 0; u < PAGED_MAX_D / PAGED_THREADS; u++) {
    const long i = ti + u * PAGED_THREADS;
    if (i < D) o[i] = store<T>(acc[u] / l);
  }
}

#define PAGED(unused, SFX, T)                                  \
  INSTANTIATE(NAME(paged_write_##SFX), paged_write<T>)         \
  INSTANTIATE(NAME(paged_attention_##SFX), paged_attention<T>)
FLOATS(PAGED, _)
