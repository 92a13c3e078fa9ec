// Multi-Latent Attention (--multi-latent-attention; DeepSeek-V2/V3, Megatron-Core's
// MLASelfAttention). x [B*S, H] -> [B*S, H]; per head h of N, qk = --qk-head-dim,
// r = --qk-pos-emb-head-dim, D = qk + r, Dv = --v-head-dim:
//   q      = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))   [T, N D]  (--q-lora-rank > 0)
//          | linear_q_proj(x)                                        (--q-lora-rank 0)
//   kv_a   = linear_kv_down_proj(x)  [T, kv_lora_rank + r]: c_kv = the first kv_lora_rank
//            columns, k_pe = the last r (one RoPE key shared by every head)
//   kv     = linear_kv_up_proj(kv_layernorm(c_kv))  [T, N (qk + Dv)]: per head k_nope, v
//   q_h    = [q_nope_h, RoPE(q_pe_h)],  k_h = [k_nope_h, RoPE(k_pe)],  v_h
//   out    = linear_proj(attention(q, k, v; scale = mscale^2 / sqrt(D)))
// mscale = yarn_mscale(--rotary-scaling-factor, --mscale-all-dim) with --rope-type yarn, else 1.
// The two latent norms exist with --qk-layernorm (Megatron's MLA spec; DeepSeek's models have
// them); --normalization picks RMSNorm or LayerNorm.
// RoPE convention: rotate-half over the r RoPE channels (ops/rope.h). DeepSeek's checkpoints
// (and HF transformers' DeepseekV3 with rope_interleave, Megatron's MLA rotary) rotate
// interleaved pairs (2i, 2i+1) after the same de-interleave: the weights of an imported model
// get their RoPE rows (each head's last r rows of q_up/q_proj, the last r rows of kv_down)
// reordered [0, 2, 4, ..., r-2, 1, 3, ..., r-1]; then q.k, and so the logits, are equal.
// Tensor parallelism: the up projections are column-parallel over heads, linear_proj
// row-parallel; the down projections and the latent norms are replicated (each rank computes
// them on the whole input), and as each rank back-propagates only its heads' share their
// gradients are partial: summed over TP (Param::tp_partial_grad). With sequence parallelism the
// input is gathered first (DenseParallel::enter_forward). Context parallelism: RoPE at the
// chunks' global positions, then the CP gather of K/V (model/core_attention.h); k_pe is
// broadcast over the heads before it.
// --recompute-modules mla_up_proj: q, k and v (the up projections' outputs after RoPE, the
// largest saved tensors) are not kept but rebuilt in the backward from the saved latents.
// --recompute-modules core_attn: the attention output and logsumexp are rebuilt in the backward
// (model/core_attention.h; with mla_up_proj after q, k and v).
// Generation (forward_cached) caches every head's K and V after the up projections (one rank).
#pragma once

#include "moecore/model/core_attention.h"
#include "moecore/model/layers.h"

namespace moecore {

class MlaAttention {
 public:
  MlaAttention() = default;
  MlaAttention(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const DenseParallel& par = {});
  struct Ctx {
    Linear::Ctx q_down, q_up, kv_down, kv_up, o;  // q_up is linear_q_proj without --q-lora-rank
    Norm::Ctx q_norm, kv_norm;
    Tensor k_pe;  // RoPE key after rotation [T, r] (for the recomputation)
    CoreAttentionCtx core;
  };
  Tensor forward(const Tensor& x, int64_t batch, Ctx& ctx) const;
  Tensor backward(const Tensor& dy, int64_t batch, Ctx& ctx) const;
  // Generation, no gradients, one rank (AttentionBlock::forward_cached's contract): the caches
  // hold each head's K [rows, max_len, N, D] (after RoPE) and V [rows, max_len, N, Dv].
  Tensor forward_cached(const Tensor& x, int64_t first_row, const std::vector<int64_t>& start, Tensor& k_cache,
                        Tensor& v_cache) const;
  double scale() const;
  int64_t heads() const { return heads_; }

 private:
  // The up projections of the latents and the attention's inputs q, k [B, S, N, D] and
  // v [B, S, N, Dv]: each query head's RoPE part rotated, k_pe [B, S, 1, r] (rotated) broadcast.
  void up_project(const Tensor& q_latent, const Tensor& kv_latent, const Tensor& k_pe, int64_t batch,
                  Linear::Ctx& q_ctx, Linear::Ctx& kv_ctx, Tensor& q, Tensor& k, Tensor& v) const;
  // The part of up_project after the projections; q [T, N D] becomes [B, S, N, D].
  void assemble(Tensor& q, const Tensor& kv, const Tensor& k_pe, int64_t batch, int64_t position_offset, Tensor& k,
                Tensor& v) const;
  // RoPE (or its backward) of t [B, s, heads, r] in place at this rank's positions (without CP:
  // position_offset + s).
  void rotate(Tensor& t, bool inverse, int64_t position_offset) const;

  Linear q_down_, q_up_, kv_down_, kv_up_, o_proj_;
  Norm q_norm_, kv_norm_;
  DenseParallel par_;
  MlaConfig mla_;
  int64_t heads_ = 0;
  bool latent_norms_ = false, recompute_ = false, recompute_core_ = false;
  double rotary_base_ = 10000.0, mscale_ = 1.0;
  ops::RopeScaling rope_scaling_;
};

}  // namespace moecore
