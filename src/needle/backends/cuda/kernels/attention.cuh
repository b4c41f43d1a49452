// The attention kernels' arguments (nn.cu, attention_simt.cu; docs/kernels.md, "nn");
// include after common.cuh.
#pragma once

struct AttnParams {
  i64 batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim, splits, chunk;
  float scale;
  int causal;
  int window;      // with causal: a sliding window (keys position - window + 1..position)
  float scale_lo;  // scale - (float)scale: float64 kernels use scale + scale_lo
  float softcap;   // scores become softcap * tanh(score / softcap) (Gemma 2); 0: none. Only
                   // nn.cu's attention kernel caps: the host sends capped calls there
};

// The first key a group of query rows r0..last (of q_len positions a head) may see: 0, or
// with a sliding window the earliest row's first key
__device__ __forceinline__ i64 attn_first_key(const AttnParams& p, i64 r0, i64 last) {
  if (!p.causal || p.window <= 0) return 0;
  const i64 min_pos = (r0 / p.q_len != last / p.q_len) ? 0 : r0 % p.q_len;
  const i64 first = p.kv_len - p.q_len + min_pos - p.window + 1;
  return first > 0 ? first : 0;
}

// Where q's and out's rows live (a by-value argument after the params): query head h of
// position i in batch b at q + b * q_batch + h * q_head + i * q_pos, the same for out.
// Heads-first arrays (batch, heads, len, D) have q_pos = D; token-major ones (batch, len,
// heads, D), e.g. the query part of a fused QKV projection, have q_head = D.
struct AttnRows { i64 q_batch, q_head, q_pos, o_batch, o_head, o_pos; };

// Where K's and V's rows live: key j of KV head h in batch b at k + b * k_batch + h * k_head
// + j * k_pos (the same for v); heads-first caches for attention, token-major projections'
// rows for a training step's forward (the *_train_* kernels).
struct KVRows { i64 k_batch, k_head, k_pos, v_batch, v_head, v_pos; };

// The rows of a backward's arrays (the training kernels' by-value argument): q, k, v, out,
// dout, dq, dk, dv: element (b, h, i, c) at off[x] + b * s[x][0] + h * s[x][1] + i * s[x][2] +
// c; dq_slab: the elements between key blocks' dQ slabs (0: dq itself; float32 kernel only)
struct AttnGrads { i64 s[8][3]; i64 off[8]; i64 dq_slab; };
enum { GQ, GK, GV, GO, GDO, GDQ, GDK, GDV };
