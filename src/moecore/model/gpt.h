// The GPT-style decoder: embedding (+ learned positions), layers of
//   h = h + attention(norm(h));  h = h + mlp_or_moe(norm(h))
// a final norm, the output head (tied to the embedding unless untied) and the cross-entropy
// loss. Parameter names follow Megatron-Core (embedding.word_embeddings.weight,
// decoder.layers.N.self_attention.linear_q.weight, decoder.layers.N.mlp.experts...,
// decoder.final_layernorm.weight, output_layer.weight).
#pragma once

#include <functional>
#include <vector>

#include "moecore/model/attention_block.h"
#include "moecore/model/layers.h"
#include "moecore/moe/moe_layer.h"

namespace moecore {

class GPTModel {
 public:
  // par: the expert-parallel and balancing groups of the MoE layers (default: one rank).
  GPTModel(const ModelConfig& cfg, ParamStore& store, const MoeParallel& par = {});

  struct LayerCtx {
    Norm::Ctx attn_norm, mlp_norm;
    AttentionBlock::Ctx attn;
    Mlp::Ctx mlp;
    MoeLayer::Ctx moe;
  };
  struct Ctx {
    Tensor token_ids, position_ids, labels;  // [T] i32
    int64_t batch = 0, num_labels = 0;
    std::vector<LayerCtx> layers;
    Norm::Ctx final_norm;
    Linear::Ctx head;
    Tensor logits, lse;  // [T, V], [T]
  };

  // tokens and labels [B, S] i32 on the model's device (labels < 0 are ignored). Returns the mean
  // loss over labelled tokens. Keeps what backward needs in ctx.
  double forward(const Tensor& tokens, const Tensor& labels, bool training, uint64_t rng_seed, Ctx& ctx);
  // grad_scale = d(objective) / d(this micro-batch's mean loss), e.g. 1 / num_microbatches.
  // layer_done(i), when given, is called once decoder layer i's parameter gradients are final
  // (its whole backward is issued): the trainer starts their reduction while the backward goes on.
  void backward(double grad_scale, Ctx& ctx, const std::function<void(int64_t)>& layer_done = {});
  // Logits [B*S, V] in the compute dtype, no loss (generation).
  Tensor logits(const Tensor& tokens);

  std::vector<MoeLayer*> moe_layers();
  std::vector<int64_t> moe_layer_numbers() const;  // decoder layer index of each moe_layers() entry
  const ModelConfig& config() const { return cfg_; }

 private:
  Tensor embed(const Tensor& tokens, Ctx& ctx);
  Tensor decoder_forward(Tensor h, bool training, uint64_t rng_seed, Ctx& ctx);

  ModelConfig cfg_;
  Param* word_embeddings_ = nullptr;
  Param* position_embeddings_ = nullptr;
  std::vector<Norm> attn_norm_, mlp_norm_;
  std::vector<AttentionBlock> attention_;
  std::vector<Mlp> mlp_;
  std::vector<MoeLayer> moe_;
  Norm final_norm_;
  Linear head_;
  DType compute_;
};

}  // namespace moecore
