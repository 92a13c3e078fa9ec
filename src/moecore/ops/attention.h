// Causal scaled-dot-product attention with grouped-query heads (GQA), forward and backward.
//
// Shapes (row-major, contiguous):
//   q, out, dout, dq  [B, S, Hq, D]     k, v, dk, dv  [B, S, Hkv, D]     lse  [B, Hq, S]
// Hq % Hkv == 0; query head h reads kv head h / (Hq / Hkv) (a group of Hq / Hkv query heads
// shares one kv head). Causal: query s attends to keys t <= s.
//
// Forward, with c = softmax_scale (callers pass 1 / sqrt(D)):
//   s_t     = c * q_s . k_t                         for t <= s
//   lse_s   = log sum_{t<=s} exp(s_t)               (kept for the backward)
//   out_s   = sum_{t<=s} exp(s_t - lse_s) v_t
// Backward (flash-attention form; P recomputed from lse, nothing of size S x S is stored):
//   P  = exp(c Q K^T - lse)   dV = P^T dO   dP = dO V^T   Dr = rowsum(dO * O)
//   dS = P * (dP - Dr)        dQ = c dS K   dK = c dS^T Q
// dk and dv of a kv head sum over the query heads of its group. dq, dk, dv are overwritten.
//
// Dtypes: q, k, v, out, dout, dq, dk, dv share one dtype: f32 or bf16 (CPU and CUDA), f64
// (CPU only, for gradient checks). lse is f32 (f64 for f64 inputs). Arithmetic is fp32 (f64
// for f64); bf16 rounding happens only when outputs are stored.
//
// Backends: the CPU evaluates the formulas row by row (OpenMP over (b, head, s)), any D.
// CUDA (D in {32, 64, 128}) is a tiled flash-attention kernel: one block per (b, q head,
// 64-query tile) with online softmax over 64-key tiles held in shared memory; backward
// computes Dr, then dQ per query tile and dK/dV per (key tile, kv head), without atomics,
// so results are deterministic.
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, Tensor& out,
                       Tensor& lse);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, double softmax_scale, Tensor& dq, Tensor& dk, Tensor& dv);

// Sizes as validated by the public functions.
struct AttentionDims {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  int64_t group() const { return q_heads / kv_heads; }  // query heads per kv head
};

namespace cpu {
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out, Tensor& lse,
                       const AttentionDims& d);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionDims& d);
}  // namespace cpu
namespace cuda {
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor& out, Tensor& lse,
                       const AttentionDims& d);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionDims& d);
}  // namespace cuda

}  // namespace moecore::ops
