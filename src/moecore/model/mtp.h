// Multi-token prediction (DeepSeek-V3; Megatron-Core's MultiTokenPredictionLayer), --mtp-num-layers D.
//
// D sequential modules run after the decoder's last layer on the stage with the output layer.
// Depth k (1..D) takes h_{k-1} (h_0: the decoder's output before the final norm) and the
// embeddings of the tokens k positions ahead (token t+k at position t; the last k positions get
// token 0, as Megatron's roll fills them, and are masked in the loss):
//   x   = eh_proj([enorm(embedding(tokens_k)), hnorm(h_{k-1})])      (embedding first, [T, 2H] -> [T, H])
//   h_k = one transformer layer (attention + the MLP or MoE of the model's last layer) of x
//   loss_k = cross-entropy of output_layer(final_layernorm(h_k)) against labels_k = the labels
//            shifted k positions left (the last k masked), the mean over its labelled tokens
// The word embedding and the output layer are the main model's (GPTModel runs them); the
// objective gains mtp_loss_scaling_factor / D * sum_k loss_k (Megatron's MTPLossAutoScaler).
// Evaluation runs no MTP (the validation loss is the main model's, as Megatron reports).
//
// Names (Megatron-Core, under "mtp.layers.<k-1>."): enorm.weight, hnorm.weight, eh_proj.weight,
// transformer_layer.{input_layernorm, self_attention.*, pre_mlp_layernorm, mlp.*} (as a decoder
// layer's), final_layernorm.weight. DeepSeek-V3's HF checkpoints keep module k as the extra layer
// model.layers.<num_layers + k - 1>: enorm, hnorm, eh_proj, shared_head.norm (= final_layernorm),
// shared_head.head (a copy of lm_head) and embed_tokens (a copy of the word embedding), plus the
// ordinary layer weights (input_layernorm, self_attn.*, post_attention_layernorm, mlp.*).
//
// Parallelism: with TP the embedding is vocabulary-parallel as the main one, the transformer
// layer splits as a decoder layer's, and eh_proj is replicated (Megatron splits its output
// features and gathers them right after: the same product); under SP every piece sees this
// rank's tokens and the replicated weights' gradients are summed over TP. CP: the shifted tokens
// and labels come from the whole sequences (make_mtp_batch, before the CP split).
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/model/attention_block.h"
#include "moecore/model/layers.h"
#include "moecore/model/mla_attention.h"
#include "moecore/moe/moe_layer.h"

namespace moecore {

// The shifted inputs of every depth: tokens and labels [B, S] i32 (depth k at index k-1), and
// each depth's labelled tokens over the whole sequences.
struct MtpBatch {
  std::vector<Tensor> tokens, labels;
  std::vector<int64_t> num_labels;
  bool empty() const { return tokens.empty(); }
};

// On the host, from whole sequences (tokens and labels [B, S] i32, contiguous, checked by
// check_batch_on_host): depth k's tokens are tokens shifted k left with 0 in the last k
// positions, its labels the labels shifted k left with -1 (ignored) there.
MtpBatch make_mtp_batch(const Tensor& tokens, const Tensor& labels, int64_t depths);

// One depth's module, without the shared embedding and output layer.
class MtpLayer {
 public:
  MtpLayer() = default;
  // prefix: "mtp.layers.<k-1>"; par / dense: the model's MoE and dense parallelism.
  MtpLayer(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const MoeParallel& par,
           const DenseParallel& dense);
  struct Ctx {
    Norm::Ctx enorm, hnorm, attn_norm, mlp_norm, final_norm;
    Linear::Ctx eh_proj;
    AttentionBlock::Ctx attn;
    MlaAttention::Ctx mla;  // --multi-latent-attention
    Mlp::Ctx mlp;
    MoeLayer::Ctx moe;
    int64_t batch = 1;
  };
  // h: the previous depth's output, emb: the embeddings of this depth's tokens, both [T, H]
  // (this rank's tokens). Returns h_k [T, H] (before final_norm).
  Tensor forward(const Tensor& h, const Tensor& emb, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx);
  // dy: the gradient of h_k (consumed). Sets the gradients of h and emb; parameter gradients
  // accumulate. loss_grad_scale: the MoE balancing losses' (MoeLayer::backward).
  void backward(Tensor dy, double loss_grad_scale, Ctx& ctx, Tensor& dh, Tensor& demb);
  MoeLayer* moe_layer() { return is_moe_ ? &moe_ : nullptr; }
  Norm final_norm;  // "final_layernorm": before the shared output layer

 private:
  Norm enorm_, hnorm_, attn_norm_, mlp_norm_;
  Linear eh_proj_;
  AttentionBlock attention_;
  MlaAttention mla_;  // --multi-latent-attention: the layer's attention instead
  bool use_mla_ = false;
  Mlp mlp_;
  MoeLayer moe_;
  bool is_moe_ = false;
  int64_t hidden_ = 0;
};

}  // namespace moecore
