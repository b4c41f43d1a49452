// The attention kernels' arguments (nn.cu, attention_simt.cu; docs/kernels.md, "nn");
// include after common.cuh.
#pragma once

struct AttnParams {
  i64 batch, q_heads, kv_heads, q_len, kv_len, kv_capacity, head_dim, splits, chunk;
  float scale;
  int causal;
  float scale_lo;  // scale - (float)scale: float64 kernels use scale + scale_lo
};

// Where q's and out's rows live (a by-value argument after the params): query head h of
// position i in batch b at q + b * q_batch + h * q_head + i * q_pos, the same for out.
// Heads-first arrays (batch, heads, len, D) have q_pos = D; token-major ones (batch, len,
// heads, D), e.g. the query part of a fused QKV projection, have q_head = D.
struct AttnRows { i64 q_batch, q_head, q_pos, o_batch, o_head, o_pos; };
