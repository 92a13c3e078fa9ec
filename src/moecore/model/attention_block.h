// Self-attention: separate q/k/v projections (GQA: Hkv <= Hq key/value heads), optional per-head
// q/k normalisation (--qk-layernorm), RoPE, causal attention, output projection. Biases: on all
// four projections with bias-linear, on q/k/v only with --add-qkv-bias (Qwen2).
// x [B*S, H] -> [B*S, H]. Saved: the projections' inputs, q/k/v after RoPE, the attention
// output and its logsumexp ("core_attn").
#pragma once

#include "moecore/model/layers.h"

namespace moecore {

class AttentionBlock {
 public:
  AttentionBlock() = default;
  AttentionBlock(ParamStore& store, const std::string& prefix, const ModelConfig& cfg);
  struct Ctx {
    Linear::Ctx q, k, v, o;
    Norm::Ctx q_norm, k_norm;
    Tensor core_q, core_k, core_v, core_out, core_lse;  // "core_attn"
  };
  Tensor forward(const Tensor& x, int64_t batch, Ctx& ctx) const;
  Tensor backward(const Tensor& dy, int64_t batch, Ctx& ctx) const;

 private:
  Linear q_proj_, k_proj_, v_proj_, o_proj_;
  Norm q_norm_, k_norm_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  bool qk_norm_ = false, rope_ = true;
  double rotary_base_ = 10000.0;
};

}  // namespace moecore
