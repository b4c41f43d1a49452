// Transformer kernels (docs/kernels.md, "nn"): row kernels (softmax, log_softmax, rmsnorm,
// add_rmsnorm, layernorm), rope, swiglu, attention (flash-style tiles; split-K partials for
// decoding) and attention_decode (one token against a KV cache, position read on the device).
#include <metal_stdlib>
using namespace metal;

struct RowParams {
  long rows, dim;
};
template <class S>
struct NormParams {
  long rows, dim;
  S eps;
};
struct RopeParams {
  long batch, seq, heads, head_dim;
};
struct AttnParams {
  long batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim, splits, chunk;
  float scale;
  int causal;
  int window;  // with causal: a sliding window (keys position - window + 1..position), 0: none
  float scale_lo;  // unused here (CUDA's float64 kernels)
  float softcap;   // scores become softcap * tanh(score / softcap) (Gemma 2); 0: none
};

struct SwigluParams {
  long n, dim;  // output elements, output row length (x rows are 2 * dim)
};
struct DecodeParams {
  long q_heads, kv_heads, head_dim, capacity, table_rows, splits, chunk;
  long window;  // a sliding window (positions p - window + 1..p), 0: none
  float scale, scale_lo;  // scale = scale + scale_lo in double; float kernels use scale
  float softcap;          // scores become softcap * tanh(score / softcap) (Gemma 2); 0: none
};

#define ROW_ARGS                                                                 \
  uint3 group [[threadgroup_position_in_grid]],                                  \
      uint3 tid [[thread_position_in_threadgroup]],                              \
      uint3 tpg [[threads_per_threadgroup]]

// ---- row kernels: threads (TX, TY); TX threads (whole simd-groups) per row, TY rows -------
struct RowSum {
  static float simd(float v) { return simd_sum(v); }
  static float combine(float a, float b) { return a + b; }
};
struct RowMax {  // NaN-propagating, as the reference's max
  static float simd(float v) { return simd_any(is_nan(v)) ? NAN : simd_max(v); }
  static float combine(float a, float b) { return nan_max(a, b); }
};

// v reduced over the TX threads of this thread's row. Every thread of the threadgroup calls
// it (rows past the end included): it synchronises the threadgroup. smem holds one value per
// simd-group of each row.
template <class R>
inline float row_reduce(float v, threadgroup float* smem, uint3 tid, uint3 tpg) {
  v = R::simd(v);
  const uint nw = tpg.x / 32;
  if (nw > 1) {
    threadgroup float* mine = smem + tid.y * nw;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous use of smem is over
    if (tid.x % 32 == 0) mine[tid.x / 32] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v = mine[0];
    for (uint w = 1; w < nw; w++) v = R::combine(v, mine[w]);
  }
  return v;
}

// softmax = exp(x - max) / sum, log_softmax = (x - max) - log(sum): the reference's formulas,
// so NaN and infinities come out as they do there
template <class T, bool LOG>
kernel void softmax_rows(device const T* a [[buffer(0)]], device T* out [[buffer(1)]],
                         constant RowParams& p [[buffer(2)]],
                         threadgroup float* smem [[threadgroup(0)]], ROW_ARGS) {
  const long row = long(group.x) * tpg.y + tid.y;
  const bool live = row < p.rows;
  device const T* x = a + (live ? row : 0) * p.dim;
  float m = -INFINITY;
  if (live)
    for (long j = tid.x; j < p.dim; j += tpg.x) m = nan_max(m, load(x[j]));
  m = row_reduce<RowMax>(m, smem, tid, tpg);
  float s = 0.0f;
  if (live)
    for (long j = tid.x; j < p.dim; j += tpg.x) s += exp(load(x[j]) - m);
  s = row_reduce<RowSum>(s, smem, tid, tpg);
  if (!live) return;
  device T* y = out + row * p.dim;
  if (LOG) {
    const float ls = log(s);
    for (long j = tid.x; j < p.dim; j += tpg.x) y[j] = store<T>((load(x[j]) - m) - ls);
  } else {
    const float inv = 1.0f / s;
    for (long j = tid.x; j < p.dim; j += tpg.x) y[j] = store<T>(exp(load(x[j]) - m) * inv);
  }
}

template <class T>
kernel void rmsnorm(device const T* x [[buffer(0)]], device const T* w [[buffer(1)]],
                    device T* out [[buffer(2)]], constant NormParams<float>& p [[buffer(3)]],
                    threadgroup float* smem [[threadgroup(0)]], ROW_ARGS) {
  const long row = long(group.x) * tpg.y + tid.y;
  const bool live = row < p.rows;
  device const T* xr = x + (live ? row : 0) * p.dim;
  float ss = 0.0f;
  if (live)
    for (long j = tid.x; j < p.dim; j += tpg.x) {
      const float v = load(xr[j]);
      ss += v * v;
    }
  ss = row_reduce<RowSum>(ss, smem, tid, tpg);
  if (!live) return;
  const float r = 1.0f / sqrt(ss / float(p.dim) + p.eps);
  device T* y = out + row * p.dim;
  for (long j = tid.x; j < p.dim; j += tpg.x) y[j] = store<T>(load(xr[j]) * r * load(w[j]));
}

// total = x + delta rounded to T (total may be x: each thread reads its elements before it
// writes them), then out = rmsnorm(total) * w from the rounded sum
template <class T>
kernel void add_rmsnorm(device const T* x [[buffer(0)]], device const T* delta [[buffer(1)]],
                        device const T* w [[buffer(2)]], device T* total [[buffer(3)]],
                        device T* out [[buffer(4)]], constant NormParams<float>& p [[buffer(5)]],
                        threadgroup float* smem [[threadgroup(0)]], ROW_ARGS) {
  const long row = long(group.x) * tpg.y + tid.y;
  const bool live = row < p.rows;
  const long base = (live ? row : 0) * p.dim;
  float ss = 0.0f;
  if (live)
    for (long j = tid.x; j < p.dim; j += tpg.x) {
      const T s = store<T>(load(x[base + j]) + load(delta[base + j]));
      total[base + j] = s;
      const float v = load(s);
      ss += v * v;
    }
  ss = row_reduce<RowSum>(ss, smem, tid, tpg);
  if (!live) return;
  const float r = 1.0f / sqrt(ss / float(p.dim) + p.eps);
  for (long j = tid.x; j < p.dim; j += tpg.x)
    out[base + j] = store<T>(load(total[base + j]) * r * load(w[j]));
}

// add_rmsnorm with delta first replaced by rmsnorm(delta) * dw, rounded to T as the separate
// rmsnorm rounds it (Gemma's sandwich norms: the block's output normed before it is added)
template <class T>
kernel void add_rmsnorm_post(device const T* x [[buffer(0)]], device const T* delta [[buffer(1)]],
                             device const T* dw [[buffer(2)]], device const T* w [[buffer(3)]],
                             device T* total [[buffer(4)]], device T* out [[buffer(5)]],
                             constant NormParams<float>& p [[buffer(6)]],
                             threadgroup float* smem [[threadgroup(0)]], ROW_ARGS) {
  const long row = long(group.x) * tpg.y + tid.y;
  const bool live = row < p.rows;
  const long base = (live ? row : 0) * p.dim;
  float sd = 0.0f;
  if (live)
    for (long j = tid.x; j < p.dim; j += tpg.x) {
      const float v = load(delta[base + j]);
      sd += v * v;
    }
  sd = row_reduce<RowSum>(sd, smem, tid, tpg);
  const float rd = 1.0f / sqrt(sd / float(p.dim) + p.eps);
  float ss = 0.0f;
  if (live)
    for (long j = tid.x; j < p.dim; j += tpg.x) {
      const float d = load(store<T>(load(delta[base + j]) * rd * load(dw[j])));
      const T s = store<T>(load(x[base + j]) + d);
      total[base + j] = s;
      const float v = load(s);
      ss += v * v;
    }
  ss = row_reduce<RowSum>(ss, smem, tid, tpg);
  if (!live) return;
  const float r = 1.0f / sqrt(ss / float(p.dim) + p.eps);
  for (long j = tid.x; j < p.dim; j += tpg.x)
    out[base + j] = store<T>(load(total[base + j]) * r * load(w[j]));
}

template <class T>
kernel void layernorm(device const T* x [[buffer(0)]], device const T* w [[buffer(1)]],
                      device const T* b [[buffer(2)]], device T* out [[buffer(3)]],
                      constant NormParams<float>& p [[buffer(4)]],
                      threadgroup float* smem [[threadgroup(0)]], ROW_ARGS) {
  const long row = long(group.x) * tpg.y + tid.y;
  const bool live = row < p.rows;
  device const T* xr = x + (live ? row : 0) * p.dim;
  float sum = 0.0f;
  if (live)
    for (long j = tid.x; j < p.dim; j += tpg.x) sum += load(xr[j]);
  const float mean = row_reduce<RowSum>(sum, smem, tid, tpg) / float(p.dim);
  float sq = 0.0f;
  if (live)
    for (long j = tid.x; j < p.dim; j += tpg.x) {
      const float d = load(xr[j]) - mean;
      sq += d * d;
    }
  const float var = row_reduce<RowSum>(sq, smem, tid, tpg) / float(p.dim);
  if (!live) return;
  const float denom = sqrt(var + p.eps);
  device T* y = out + row * p.dim;
  for (long j = tid.x; j < p.dim; j += tpg.x)
    y[j] = store<T>((load(xr[j]) - mean) / denom * load(w[j]) + load(b[j]));
}

// ---- rope: x (batch, seq, heads, head_dim), cos/sin (seq, head_dim/2), half-split ---------
template <class T>
kernel void rope(device const T* x [[buffer(0)]], device const T* cs [[buffer(1)]],
                 device const T* sn [[buffer(2)]], device T* out [[buffer(3)]],
                 constant RopeParams& p [[buffer(4)]], GRID_ARGS) {
  const long half_dim = p.head_dim / 2;
  GRID_STRIDE(e, p.batch * p.seq * p.heads * half_dim) {
    const long i = e % half_dim, q = e / half_dim;
    const long s = (q / p.heads) % p.seq;
    const long base = q * p.head_dim;
    const float x1 = load(x[base + i]), x2 = load(x[base + i + half_dim]);
    const float c = load(cs[s * half_dim + i]), sv = load(sn[s * half_dim + i]);
    out[base + i] = store<T>(x1 * c - x2 * sv);
    out[base + i + half_dim] = store<T>(x2 * c + x1 * sv);
  }
}

// ---- swiglu: out (rows, dim) = silu(x[:, :dim]) * x[:, dim:] of x (rows, 2 * dim) ----------
inline float swiglu_silu(float a) {
  return a * (0.5f * (tanh(0.5f * a) + 1.0f));  // numpy_ref's sigmoid formula
}

template <class T>
kernel void swiglu(device const T* x [[buffer(0)]], device T* out [[buffer(1)]],
                   constant SwigluParams& p [[buffer(2)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) {
    const long r = i / p.dim, j = i - r * p.dim;
    const long g = r * 2 * p.dim + j;
    out[i] = store<T>(swiglu_silu(load(x[g])) * load(x[g + p.dim]));
  }
}

// ---- attention -----------------------------------------------------------------------------
// A threadgroup: 32 query rows of one (batch, kv head) x 32-key tiles. Each of the 8
// simd-groups owns 4 rows; lane j scores key j of the tile against a row, the simd-group folds
// the tile into the row's running max / sum / output (lanes over head_dim, 8 values each,
// head_dim <= 256). The row's probabilities go through threadgroup memory (one write, one
// simd-group barrier) rather than 32 shuffles. The K/V cache may be longer than kv_len
// (capacity): only its first kv_len positions are read.
enum { ROWS = 32, KEYS = 32, RPW = 4, DPL = 8 };

template <class T>
kernel void attention(device const T* q [[buffer(0)]], device const T* k [[buffer(1)]],
                      device const T* v [[buffer(2)]], device T* out [[buffer(3)]],
                      device float* part_o [[buffer(4)]], device float* part_ml [[buffer(5)]],
                      constant AttnParams& p [[buffer(6)]],
                      threadgroup float* smem [[threadgroup(0)]], ROW_ARGS) {
  threadgroup float probs[ROWS * KEYS];
  const int D = int(p.head_dim), lane = int(tid.x), sg = int(tid.y);
  const int t = sg * 32 + lane;
  threadgroup float* Qs = smem;
  threadgroup float* Ks = Qs + ROWS * D;
  threadgroup float* Vs = Ks + KEYS * (D + 1);
  const long grp = p.q_heads / p.kv_heads, rows_total = grp * p.q_len;
  const long b = group.y / p.kv_heads, kvh = group.y % p.kv_heads;
  const long r0 = long(group.x) * ROWS;
  const long split = group.z;

  for (int idx = t; idx < ROWS * D; idx += 256) {
    const int r = idx / D, d = idx % D;
    const long row = r0 + r;
    float val = 0.0f;
    if (row < rows_total) {
      const long hq = kvh * grp + row / p.q_len, pos = row % p.q_len;
      val = load(q[((b * p.q_heads + hq) * p.q_len + pos) * D + d]) * p.scale;
    }
    Qs[r * D + d] = val;
  }

  const long last = lmin(r0 + ROWS - 1, rows_total - 1);
  const long max_pos = (r0 / p.q_len != last / p.q_len) ? p.q_len - 1 : last % p.q_len;
  long k_begin = split * p.chunk;
  long k_end = lmin(k_begin + p.chunk, p.kv_len);
  if (p.causal) k_end = lmin(k_end, p.kv_len - p.q_len + max_pos + 1);
  if (p.causal && p.window > 0) {  // no key before the group's earliest window
    const long min_pos = (r0 / p.q_len != last / p.q_len) ? 0 : r0 % p.q_len;
    const long lo = p.kv_len - p.q_len + min_pos - long(p.window) + 1;
    k_begin = lo > k_begin ? lo : k_begin;
  }

  float m[RPW], l[RPW], o[RPW][DPL];
  long limit[RPW], first[RPW];
  for (int i = 0; i < RPW; i++) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
    for (int c = 0; c < DPL; c++) o[i][c] = 0.0f;
    const long row = r0 + sg * RPW + i;
    limit[i] = p.causal ? p.kv_len - p.q_len + row % p.q_len : p.kv_len - 1;
    first[i] = p.causal && p.window > 0 ? limit[i] - p.window + 1 : 0;
  }

  device const T* kbase = k + (b * p.kv_heads + kvh) * p.kv_capacity * D;
  device const T* vbase = v + (b * p.kv_heads + kvh) * p.kv_capacity * D;
  for (long kt = k_begin; kt < k_end; kt += KEYS) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int idx = t; idx < KEYS * D; idx += 256) {
      const int j = idx / D, d = idx % D;
      const bool ok = kt + j < k_end;
      Ks[j * (D + 1) + d] = ok ? load(kbase[(kt + j) * D + d]) : 0.0f;
      Vs[j * D + d] = ok ? load(vbase[(kt + j) * D + d]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const long key = kt + lane;
    for (int i = 0; i < RPW; i++) {
      const int r = sg * RPW + i;
      if (r0 + r >= rows_total) continue;  // uniform across the simd-group
      float s = 0.0f;
      threadgroup const float* qr = Qs + r * D;
      threadgroup const float* kr = Ks + lane * (D + 1);
      for (int d = 0; d < D; d++) s += qr[d] * kr[d];
      s = soft_cap(s, p.softcap);  // q was scaled: s is the scaled score
      if (key >= k_end || key > limit[i] || key < first[i]) s = -INFINITY;
      const float mn = max(m[i], simd_max(s));
      if (mn == -INFINITY) continue;  // nothing visible yet (uniform)
      const float pj = s == -INFINITY ? 0.0f : exp(s - mn);
      const float alpha = m[i] == -INFINITY ? 0.0f : exp(m[i] - mn);
      l[i] = l[i] * alpha + simd_sum(pj);
      m[i] = mn;
      probs[r * KEYS + lane] = pj;
      simdgroup_barrier(mem_flags::mem_threadgroup);
      for (int c = 0; c < DPL; c++) o[i][c] *= alpha;
      for (int j = 0; j < KEYS; j++) {
        const float pk = probs[r * KEYS + j];
        threadgroup const float* vr = Vs + j * D;
        for (int c = 0; c < DPL; c++) {
          const int d = lane + 32 * c;
          if (d < D) o[i][c] += pk * vr[d];
        }
      }
    }
  }

  for (int i = 0; i < RPW; i++) {
    const long row = r0 + sg * RPW + i;
    if (row >= rows_total) continue;
    const long hq = kvh * grp + row / p.q_len, pos = row % p.q_len;
    const long orow = (b * p.q_heads + hq) * p.q_len + pos;
    if (p.splits == 1) {
      const float inv = 1.0f / l[i];
      for (int c = 0; c < DPL; c++) {
        const int d = lane + 32 * c;
        if (d < D) out[orow * D + d] = store<T>(o[i][c] * inv);
      }
    } else {
      const long slot = orow * p.splits + split;
      for (int c = 0; c < DPL; c++) {
        const int d = lane + 32 * c;
        if (d < D) part_o[slot * D + d] = o[i][c];
      }
      if (lane == 0) {
        part_ml[slot * 2] = m[i];
        part_ml[slot * 2 + 1] = l[i];
      }
    }
  }
}

// merge the splits of one output row (a simd-group per row)
template <class T>
kernel void attention_combine(device const float* part_o [[buffer(0)]],
                              device const float* part_ml [[buffer(1)]],
                              device T* out [[buffer(2)]], constant AttnParams& p [[buffer(3)]],
                              ROW_ARGS) {
  const long rows = p.batch * p.q_heads * p.q_len;
  const long row = long(group.x) * tpg.y + tid.y;
  if (row >= rows) return;
  const int D = int(p.head_dim);
  float mx = -INFINITY;
  for (long s = 0; s < p.splits; s++) mx = max(mx, part_ml[(row * p.splits + s) * 2]);
  float acc[DPL], total = 0.0f;
  for (int c = 0; c < DPL; c++) acc[c] = 0.0f;
  for (long s = 0; s < p.splits; s++) {
    const long slot = row * p.splits + s;
    const float ls = part_ml[slot * 2 + 1];
    if (ls == 0.0f) continue;
    const float wgt = exp(part_ml[slot * 2] - mx);
    total += ls * wgt;
    for (int c = 0; c < DPL; c++) {
      const int d = int(tid.x) + 32 * c;
      if (d < D) acc[c] += part_o[slot * D + d] * wgt;
    }
  }
  for (int c = 0; c < DPL; c++) {
    const int d = int(tid.x) + 32 * c;
    if (d < D) out[row * D + d] = store<T>(acc[c] / total);
  }
}

// ---- attention_decode: one token's step at the position held in device memory -------------
// A threadgroup of 128 threads (4 simd-groups) per (KV head, chunk of `chunk` cache positions),
// grid (kv_heads, splits). Every query head of the KV head's group is computed here, so the
// chunk of K and V is read once for all of them. Threadgroup memory (dynamic): the group's
// roped queries (group x head_dim) and their scores, then probabilities (group x chunk), in
// float. Chunks starting after p return at once; the chunk holding p ropes the key, writes key
// and value to row p of the caches and reads them back after a device-memory barrier. Each
// group leaves, per query head and chunk, the unnormalised output (part_o) and the running
// max and sum of exponentials (part_ml); attention_decode_combine merges the chunks.
inline bool decode_position_ok(int pos, constant DecodeParams& p) {
  return pos >= 0 && long(pos) < lmin(p.capacity, p.table_rows);
}

// the first position the step at pos attends to: 0, or the start of its sliding window
inline long decode_window_start(int pos, constant DecodeParams& p) {
  return p.window > 0 && long(pos) >= p.window ? long(pos) - p.window + 1 : 0;
}

template <class T>
kernel void attention_decode(device const T* qkv [[buffer(0)]], device const T* cs [[buffer(1)]],
                             device const T* sn [[buffer(2)]],
                             device const int* position [[buffer(3)]], device T* keys [[buffer(4)]],
                             device T* values [[buffer(5)]], device float* part_o [[buffer(6)]],
                             device float* part_ml [[buffer(7)]],
                             constant DecodeParams& p [[buffer(8)]],
                             threadgroup float* smem [[threadgroup(0)]], ROW_ARGS) {
  const int pos = position[0];
  const long kvh = group.x, split = group.y;
  const long c0 = split * p.chunk, lo = decode_window_start(pos, p);
  // chunks past p or wholly before the window: nothing (uniform over the group)
  if (!decode_position_ok(pos, p) || c0 > long(pos) || c0 + p.chunk <= lo) return;
  const int D = int(p.head_dim), H = D / 2, t = int(tid.x), lane = t % 32, sg = t / 32;
  const int grp = int(p.q_heads / p.kv_heads), chunk = int(p.chunk);
  const int n = int(lmin(long(pos) + 1 - c0, p.chunk));  // positions of this chunk in use
  threadgroup float* Qs = smem;               // [grp][D]
  threadgroup float* Ps = smem + grp * D;     // [grp][chunk]
  device const T* c = cs + long(pos) * H;
  device const T* s = sn + long(pos) * H;

  // RoPE of the group's queries, rounded to T as the rope function's output is
  for (int idx = t; idx < grp * H; idx += 128) {
    const int g = idx / H, i = idx % H;
    device const T* x = qkv + (kvh * grp + g) * D;
    const float a = load(x[i]), b = load(x[H + i]), cc = load(c[i]), ss = load(s[i]);
    Qs[g * D + i] = load(store<T>(a * cc - b * ss));
    Qs[g * D + H + i] = load(store<T>(b * cc + a * ss));
  }
  device T* kc = keys + kvh * p.capacity * D;
  device T* vc = values + kvh * p.capacity * D;
  if (long(pos) < c0 + chunk) {  // this chunk holds p: store the new key and value
    device const T* x = qkv + (p.q_heads + kvh) * D;
    device const T* v = qkv + (p.q_heads + p.kv_heads + kvh) * D;
    device T* krow = kc + long(pos) * D;
    device T* vrow = vc + long(pos) * D;
    for (int i = t; i < H; i += 128) {
      const float a = load(x[i]), b = load(x[H + i]), cc = load(c[i]), ss = load(s[i]);
      krow[i] = store<T>(a * cc - b * ss);
      krow[H + i] = store<T>(b * cc + a * ss);
    }
    for (int i = t; i < D; i += 128) vrow[i] = v[i];
  }
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);

  // scores: a simd-group per key, lanes over head_dim (coalesced reads of the key row)
  for (int j = sg; j < n; j += 4) {
    device const T* kr = kc + (c0 + j) * D;
    float kv[DPL];
    for (int e = 0; e < DPL; e++) {
      const int d = lane + 32 * e;
      kv[e] = d < D ? load(kr[d]) : 0.0f;
    }
    for (int g = 0; g < grp; g++) {
      float dot = 0.0f;
      for (int e = 0; e < DPL; e++) {
        const int d = lane + 32 * e;
        if (d < D) dot += Qs[g * D + d] * kv[e];
      }
      dot = simd_sum(dot);
      if (lane == 0)
        Ps[g * chunk + j] = c0 + j < lo ? -INFINITY : soft_cap(dot * p.scale, p.softcap);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // per query head: max and sum of exponentials over the chunk (a simd-group per head)
  for (int g = sg; g < grp; g += 4) {
    threadgroup float* row = Ps + g * chunk;
    float m = -INFINITY;
    for (int j = lane; j < n; j += 32) m = nan_max(m, row[j]);
    m = simd_any(is_nan(m)) ? NAN : simd_max(m);
    float l = 0.0f;
    for (int j = lane; j < n; j += 32) {
      const float e = exp(row[j] - m);
      row[j] = e;
      l += e;
    }
    l = simd_sum(l);
    if (lane == 0) {
      const long slot = (kvh * grp + g) * p.splits + split;
      part_ml[slot * 2] = m;
      part_ml[slot * 2 + 1] = l;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // unnormalised outputs: threads over (head, d), coalesced reads of the value rows
  for (int idx = t; idx < grp * D; idx += 128) {
    const int g = idx / D, d = idx % D;
    threadgroup const float* row = Ps + g * chunk;
    float acc = 0.0f;
    for (int j = 0; j < n; j++) acc += row[j] * load(vc[(c0 + j) * D + d]);
    part_o[((kvh * grp + g) * p.splits + split) * D + d] = acc;
  }
}

// grid q_heads, threads head_dim rounded up to 32: merge the chunks 0..p / chunk of a head
template <class T>
kernel void attention_decode_combine(device const int* position [[buffer(0)]],
                                     device const float* part_o [[buffer(1)]],
                                     device const float* part_ml [[buffer(2)]],
                                     device T* out [[buffer(3)]],
                                     constant DecodeParams& p [[buffer(4)]], ROW_ARGS) {
  const long h = group.x, d = tid.x;
  if (d >= p.head_dim) return;
  const int pos = position[0];
  device T* o = out + h * p.head_dim + d;
  if (!decode_position_ok(pos, p)) {
    *o = store<T>(NAN);
    return;
  }
  const long used = long(pos) / p.chunk + 1, first = decode_window_start(pos, p) / p.chunk;
  device const float* ml = part_ml + h * p.splits * 2;
  float mx = -INFINITY;
  for (long s = first; s < used; s++) mx = nan_max(mx, ml[s * 2]);
  float acc = 0.0f, total = 0.0f;
  for (long s = first; s < used; s++) {
    const float w = exp(ml[s * 2] - mx);
    total += ml[s * 2 + 1] * w;
    acc += part_o[(h * p.splits + s) * p.head_dim + d] * w;
  }
  *o = store<T>(acc / total);
}
// ---- qk_rmsnorm: a thread a head row of a fused q/k/v projection: query rows normed with qw,
// key rows with kw, value rows copied (numpy_ref.qk_rmsnorm) ----------------------------------
struct QkNormParams {
  long rows, q_heads, kv_heads, head_dim;
  float eps;
};

template <class T>
kernel void qk_rmsnorm(device const T* x [[buffer(0)]], device const T* qw [[buffer(1)]],
                       device const T* kw [[buffer(2)]], device T* out [[buffer(3)]],
                       constant QkNormParams& p [[buffer(4)]], GRID_ARGS) {
  const long D = p.head_dim, heads = p.q_heads + 2 * p.kv_heads;
  GRID_STRIDE(r, p.rows) {
    device const T* xr = x + r * D;
    device T* o = out + r * D;
    const long h = r % heads;
    if (h >= p.q_heads + p.kv_heads) {
      for (long j = 0; j < D; j++) o[j] = xr[j];
      continue;
    }
    device const T* w = h < p.q_heads ? qw : kw;
    float ss = 0.0f;
    for (long j = 0; j < D; j++) {
      const float v = load(xr[j]);
      ss += v * v;
    }
    const float rs = 1.0f / sqrt(ss / float(D) + p.eps);
    for (long j = 0; j < D; j++) o[j] = store<T>(load(xr[j]) * rs * load(w[j]));
  }
}

// ---- geglu: out (rows, dim) = gelu_tanh(x[:, :dim]) * x[:, dim:] (Gemma's GeGLU) ------------
template <class T>
kernel void geglu(device const T* x [[buffer(0)]], device T* out [[buffer(1)]],
                  constant SwigluParams& p [[buffer(2)]], GRID_ARGS) {
  GRID_STRIDE(i, p.n) {
    const long r = i / p.dim, j = i - r * p.dim;
    const long g = r * 2 * p.dim + j;
    const float a = load(x[g]);
    const float inner = (a + a * a * a * 0.044715f) * 0.7978845608028654f;
    out[i] = store<T>(a * (tanh(inner) + 1.0f) * 0.5f * load(x[g + p.dim]));
  }
}

#define NN(unused, SFX, T)                                                       \
  INSTANTIATE(NAME(softmax_##SFX), softmax_rows<T, false>)                       \
  INSTANTIATE(NAME(log_softmax_##SFX), softmax_rows<T, true>)                    \
  INSTANTIATE(NAME(rmsnorm_##SFX), rmsnorm<T>)                                   \
  INSTANTIATE(NAME(add_rmsnorm_##SFX), add_rmsnorm<T>)                           \
  INSTANTIATE(NAME(add_rmsnorm_post_##SFX), add_rmsnorm_post<T>)                 \
  INSTANTIATE(NAME(layernorm_##SFX), layernorm<T>)                               \
  INSTANTIATE(NAME(rope_##SFX), rope<T>)                                         \
  INSTANTIATE(NAME(swiglu_##SFX), swiglu<T>)                                     \
  INSTANTIATE(NAME(geglu_##SFX), geglu<T>)                                       \
  INSTANTIATE(NAME(qk_rmsnorm_##SFX), qk_rmsnorm<T>)                             \
  INSTANTIATE(NAME(attention_##SFX), attention<T>)                               \
  INSTANTIATE(NAME(attention_combine_##SFX), attention_combine<T>)                \
  INSTANTIATE(NAME(attention_decode_##SFX), attention_decode<T>)                 \
  INSTANTIATE(NAME(attention_decode_combine_##SFX), attention_decode_combine<T>)
FLOATS(NN, _)
