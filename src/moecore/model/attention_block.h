// Self-attention: separate q/k/v projections (GQA: Hkv <= Hq key/value heads), optional per-head
// q/k normalisation (--qk-layernorm), RoPE, causal attention, output projection. Biases: on all
// four projections with bias-linear, on q/k/v only with --add-qkv-bias (Qwen2).
// x [B*S, H] -> [B*S, H]. Saved: the projections' inputs, q/k/v after RoPE, the attention
// output and its logsumexp ("core_attn"; with --recompute-modules core_attn not: the attention
// forward reruns on the kept q, k, v at the start of the backward; with CP on the kept query
// chunks and gathered K / V, no communication).
// Tensor parallelism: q/k/v column-parallel (this rank's Hq/TP query heads and Hkv/TP kv heads,
// whole GQA groups), the output projection row-parallel; with sequence parallelism x and the
// result are this rank's [B, S/TP] slice (DenseParallel::enter/exit). q/k norm weights are
// replicated and see only this rank's heads: their gradients are summed over TP.
// Context parallelism: x holds this rank's two chunks of every sequence (tensor_parallel.h);
// RoPE uses their global positions; each query chunk attends the keys before it, gathered from
// the CP group (an all-gather of K and V; their gradients reduce-scatter back).
// Generation (forward_cached): K and V after RoPE go into a preallocated cache
// [rows, max_len, Hkv, D] per layer; each row's queries attend to its cached keys (one rank).
#pragma once

#include "moecore/model/layers.h"

namespace moecore {

class AttentionBlock {
 public:
  AttentionBlock() = default;
  AttentionBlock(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const DenseParallel& par = {});
  struct Ctx {
    Linear::Ctx q, k, v, o;
    Norm::Ctx q_norm, k_norm;
    Tensor core_q, core_k, core_v, core_out, core_lse;  // "core_attn"
    // Context parallelism: per query chunk, its queries, output and lse; K/V of the whole sequence.
    Tensor chunk_q[2], chunk_out[2], chunk_lse[2], full_k, full_v;
  };
  Tensor forward(const Tensor& x, int64_t batch, Ctx& ctx) const;
  Tensor backward(const Tensor& dy, int64_t batch, Ctx& ctx) const;
  // Generation, no gradients, one rank: x [R*S, H] holds S new tokens of each of R sequences;
  // sequence r is row first_row + r of k_cache and v_cache [rows, max_len, Hkv, D] and its
  // tokens sit at positions start[r] .. start[r] + S - 1. Their K and V (after RoPE) are written
  // into the cache at those positions; each query attends to its row's keys [0, its position]
  // (the attention op's bottom-right causal alignment). Rows attend one by one, so every row
  // may have its own length (no padding). Returns [R*S, H]. One token per row (S == 1, a
  // decoding step of the whole cache, first_row 0) goes through ops::decode_attention with
  // `positions` (start as i32 on the model's device): one launch for every row on a GPU.
  Tensor forward_cached(const Tensor& x, int64_t first_row, const std::vector<int64_t>& start, const Tensor& positions,
                        Tensor& k_cache, Tensor& v_cache) const;
  // One decoding step of every cache row: x [R, H] (R = the cache's rows), positions [R] i32 on
  // x's device. Reads nothing back to the host on a GPU (CUDA graphs capture it); f64 (CPU) takes
  // forward_cached's row-by-row path.
  Tensor forward_decode(const Tensor& x, const Tensor& positions, Tensor& k_cache, Tensor& v_cache) const;
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }

 private:
  // Context parallelism: causal attention of this rank's two query chunks over the gathered keys.
  Tensor context_parallel_forward(const Tensor& q, const Tensor& k, const Tensor& v, Ctx& ctx) const;
  void context_parallel_backward(const Tensor& dout, Ctx& ctx, Tensor& dq, Tensor& dk, Tensor& dv) const;
  // --recompute-modules core_attn with CP: the chunks' outputs and logsumexps again; returns the output.
  Tensor context_parallel_rerun(Ctx& ctx) const;
  double scale() const;

  Linear q_proj_, k_proj_, v_proj_, o_proj_;
  DenseParallel par_;
  Norm q_norm_, k_norm_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  bool qk_norm_ = false, rope_ = true, recompute_core_ = false;
  double rotary_base_ = 10000.0;
};

}  // namespace moecore
