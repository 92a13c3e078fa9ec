// One decoding step of attention against a KV cache, for a batch of sequences of different
// lengths (generation: model/attention_block.cpp).
//
//   q [R, 1, Hq, D]   k_new [R, 1, Hkv, D]   v_new [R, 1, Hkv, Dv]
//   k_cache [R, max_len, Hkv, D]   v_cache [R, max_len, Hkv, Dv]
//   positions [R] i32 on the tensors' device: the position of each row's new token
//   out [R, 1, Hq, Dv]   lse [R, Hq, 1] (f32)
// Any head dims D and Dv (Dv = D for ordinary attention; MLA's values are narrower).
// For each row r at position p = positions[r] < max_len: RoPE (when `rope`, base `rope_base`,
// the rotate-half form of ops/rope.h) rotates q[r] and k_new[r] to position p; k_new[r] and
// v_new[r] are written into the caches at p; then q[r] attends to the keys 0..p of its cache row
// (softmax scale `scale`, GQA: query head h reads kv head h / (Hq / Hkv)), as ops::attention
// with Sq = 1, Sk = p + 1. q is rotated in place; k_new may be overwritten.
// Dtypes: f32 or bf16 (f64 on the CPU), all tensors alike but lse; arithmetic in fp32.
// CPU: per row ops::rope_forward, two copies and ops::attention_forward (the reference). CUDA:
// three kernels for the whole batch, whatever the rows' lengths: one rotates q and k and writes
// the cache (angles in double as the RoPE op's table); one block per (row, query head, key chunk)
// takes its chunk of the p + 1 keys (softmax max and sum over the chunk, the unnormalised value
// sum); one merges each (row, head)'s chunks. Odd or > 256 D, or Dv > 256, fall back to the
// per-row path (which reads the positions on the host; its ops::attention_forward takes any D
// and Dv on CUDA too).
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void decode_attention(Tensor& q, Tensor& k_new, const Tensor& v_new, Tensor& k_cache, Tensor& v_cache,
                      const Tensor& positions, bool rope, double rope_base, double scale, Tensor& out, Tensor& lse);

namespace cuda {
void decode_attention(Tensor& q, const Tensor& k_new, const Tensor& v_new, Tensor& k_cache, Tensor& v_cache,
                      const Tensor& positions, bool rope, double rope_base, double scale, Tensor& out, Tensor& lse);
}  // namespace cuda

}  // namespace moecore::ops
