#include "moecore/model/gpt.h"

#include <cmath>

#include "moecore/ops/cross_entropy.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/embedding.h"
#include "moecore/ops/reduce.h"

namespace moecore {

GPTModel::GPTModel(const ModelConfig& cfg, ParamStore& store, const MoeParallel& par, const PipelineStage& stage)
    : cfg_(cfg), stage_(stage), compute_(store.compute_dtype()) {
  if (stage_.end_layer < 0) stage_.end_layer = cfg.num_layers;
  MC_CHECK(stage_.first_layer >= 0 && stage_.first_layer <= stage_.end_layer && stage_.end_layer <= cfg.num_layers,
           "pipeline stage layers [", stage_.first_layer, ", ", stage_.end_layer, ") are outside [0, ", cfg.num_layers, ")");
  if (store.master_dtype() == DType::F64) compute_ = DType::F64;
  const int64_t h = cfg.hidden_size;
  const double std = cfg.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  // Tied embeddings: the last pipeline stage keeps its own copy for the output layer (same name,
  // so the same Philox draw; the trainer sums both copies' gradients over the embedding group).
  if (stage_.has_embedding || (stage_.has_head && !cfg.untie_embeddings))
    word_embeddings_ = &store.add("embedding.word_embeddings.weight", {cfg.vocab_size, h}, Init::Normal, std, true);
  if (stage_.has_embedding && cfg.position_embedding_type == "learned_absolute")
    position_embeddings_ = &store.add("embedding.position_embeddings.weight", {cfg.max_position_embeddings, h},
                                      Init::Normal, std, true);
  // Every layer has a slot (indexed by its global number); only this stage's are built.
  attn_norm_.resize(static_cast<size_t>(cfg.num_layers));
  mlp_norm_.resize(static_cast<size_t>(cfg.num_layers));
  attention_.resize(static_cast<size_t>(cfg.num_layers));
  mlp_.resize(static_cast<size_t>(cfg.num_layers));
  moe_.resize(static_cast<size_t>(cfg.num_layers));
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i) {
    const size_t li = static_cast<size_t>(i);
    const std::string p = "decoder.layers." + std::to_string(i);
    attn_norm_[li] = Norm(store, p + ".input_layernorm", h, cfg.rmsnorm, cfg.norm_epsilon);
    attention_[li] = AttentionBlock(store, p + ".self_attention", cfg);
    mlp_norm_[li] = Norm(store, p + ".pre_mlp_layernorm", h, cfg.rmsnorm, cfg.norm_epsilon);
    if (cfg.is_moe(i)) {
      moe_[li] = MoeLayer(store, p + ".mlp", cfg, par);
    } else {
      mlp_[li] = Mlp(store, p + ".mlp", h, cfg.ffn_hidden_size, cfg.swiglu, cfg.add_bias_linear, std, out_std);
    }
  }
  if (stage_.has_head) {
    final_norm_ = Norm(store, "decoder.final_layernorm", h, cfg.rmsnorm, cfg.norm_epsilon);
    head_ = Linear(store, "output_layer", h, cfg.vocab_size, false, std, cfg.untie_embeddings ? nullptr : word_embeddings_);
  }
}

std::vector<MoeLayer*> GPTModel::moe_layers() {
  std::vector<MoeLayer*> out;
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i)
    if (cfg_.is_moe(i)) out.push_back(&moe_[static_cast<size_t>(i)]);
  return out;
}

std::vector<int64_t> GPTModel::moe_layer_numbers() const {
  std::vector<int64_t> out;
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i)
    if (cfg_.is_moe(i)) out.push_back(i);
  return out;
}

Tensor GPTModel::embed(const Tensor& tokens, Ctx& ctx) {
  MC_CHECK(tokens.ndim() == 2 && tokens.dtype() == DType::I32, "model input must be [batch, seq] i32, got ",
           tokens.describe());
  const int64_t batch = tokens.size(0), seq = tokens.size(1), n = batch * seq;
  MC_CHECK(seq <= cfg_.max_position_embeddings, "sequence of ", seq, " tokens exceeds --max-position-embeddings ",
           cfg_.max_position_embeddings);
  ctx.batch = batch;
  ctx.token_ids = tokens.view({n});
  Tensor x = Tensor::empty({n, cfg_.hidden_size}, compute_, tokens.device());
  ops::embedding_forward(word_embeddings_->weight, ctx.token_ids, x);
  if (position_embeddings_) {
    std::vector<int32_t> pos(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(i % seq);
    ctx.position_ids = Tensor::from_vector(pos, {n}, tokens.device());
    Tensor p = Tensor::empty(x.shape(), compute_, tokens.device());
    ops::embedding_forward(position_embeddings_->weight, ctx.position_ids, p);
    add_into(x, p);
  }
  return x;
}

Tensor GPTModel::decoder_forward(Tensor h, bool training, uint64_t rng_seed, Ctx& ctx) {
  ctx.layers.resize(static_cast<size_t>(cfg_.num_layers));
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i) {
    const size_t li = static_cast<size_t>(i);
    LayerCtx& lc = ctx.layers[li];
    // New tensors for the residual stream: the norms keep their inputs for the backward.
    h = add_tensors(h, attention_[li].forward(attn_norm_[li].forward(h, lc.attn_norm), ctx.batch, lc.attn));
    const Tensor normed = mlp_norm_[li].forward(h, lc.mlp_norm);
    if (cfg_.is_moe(i)) {
      h = add_tensors(h, moe_[li].forward(normed, ctx.batch, training, rng_seed + 0x9E3779B97F4A7C15ull * (li + 1), lc.moe));
    } else {
      h = add_tensors(h, mlp_[li].forward(normed, lc.mlp));
    }
  }
  return stage_.has_head ? final_norm_.forward(h, ctx.final_norm) : h;
}

double GPTModel::forward(const Tensor& tokens, const Tensor& labels, bool training, uint64_t rng_seed, Ctx& ctx,
                         const Tensor& hidden_in) {
  MC_CHECK(labels.shape() == tokens.shape() && labels.dtype() == DType::I32, "labels must match tokens ",
           tokens.describe(), ", got ", labels.describe());
  Tensor input;
  if (stage_.has_embedding) {
    input = embed(tokens, ctx);
  } else {
    MC_CHECK(hidden_in.defined() && hidden_in.ndim() == 2 && hidden_in.size(0) == tokens.numel() &&
                 hidden_in.size(1) == cfg_.hidden_size,
             "pipeline stage input must be [", tokens.numel(), ", ", cfg_.hidden_size, "], got ",
             hidden_in.defined() ? hidden_in.describe() : std::string("nothing"));
    ctx.batch = tokens.size(0);
    input = hidden_in;
  }
  Tensor h = decoder_forward(input, training, rng_seed, ctx);
  if (!stage_.has_head) {
    ctx.hidden_out = h;
    return 0.0;
  }
  const int64_t n = h.size(0);
  ctx.labels = labels.view({n});
  ctx.logits = head_.forward(h, ctx.head);
  const DType stat = compute_ == DType::F64 ? DType::F64 : DType::F32;
  Tensor loss = Tensor::empty({n}, stat, h.device());
  ctx.lse = Tensor::empty({n}, stat, h.device());
  ops::cross_entropy_forward(ctx.logits, ctx.labels, loss, ctx.lse);
  ctx.num_labels = 0;
  for (int32_t l : ctx.labels.to_vector<int32_t>()) ctx.num_labels += l >= 0 ? 1 : 0;
  Tensor total = Tensor::empty({1}, stat, h.device());
  ops::sum_all(loss, total);
  const double sum = stat == DType::F64 ? total.to_vector<double>()[0] : total.to_vector<float>()[0];
  return ctx.num_labels > 0 ? sum / static_cast<double>(ctx.num_labels) : 0.0;
}

Tensor GPTModel::backward(double grad_scale, Ctx& ctx, const std::function<void(int64_t)>& layer_done,
                          const Tensor& d_hidden_out) {
  Tensor dh;
  if (stage_.has_head) {
    MC_CHECK(ctx.logits.defined(), "GPTModel::backward without a forward");
    const int64_t n = ctx.logits.size(0);
    Tensor dloss = Tensor::empty({n}, ctx.lse.dtype(), ctx.logits.device());
    ops::fill(dloss, ctx.num_labels > 0 ? grad_scale / static_cast<double>(ctx.num_labels) : 0.0);
    ops::cross_entropy_backward(ctx.logits, ctx.labels, ctx.lse, dloss, ctx.logits);  // in place
    dh = final_norm_.backward(head_.backward(ctx.logits, ctx.head), ctx.final_norm);
    ctx.logits = ctx.lse = Tensor();
  } else {
    MC_CHECK(ctx.hidden_out.defined() && d_hidden_out.defined() && d_hidden_out.shape() == ctx.hidden_out.shape(),
             "pipeline stage backward needs the gradient of its output ", ctx.hidden_out.describe());
    dh = d_hidden_out.clone();  // accumulated into below
    ctx.hidden_out = Tensor();
  }
  for (int64_t i = stage_.end_layer - 1; i >= stage_.first_layer; --i) {
    const size_t li = static_cast<size_t>(i);
    LayerCtx& lc = ctx.layers[li];
    Tensor d_normed = cfg_.is_moe(i) ? moe_[li].backward(dh, grad_scale, lc.moe) : mlp_[li].backward(dh, lc.mlp);
    add_into(dh, mlp_norm_[li].backward(d_normed, lc.mlp_norm));
    add_into(dh, attn_norm_[li].backward(attention_[li].backward(dh, ctx.batch, lc.attn), lc.attn_norm));
    if (layer_done) layer_done(i);
  }
  Tensor d_input;
  if (stage_.has_embedding) {
    ops::embedding_backward(ctx.token_ids, dh, word_embeddings_->grad);
    if (position_embeddings_) ops::embedding_backward(ctx.position_ids, dh, position_embeddings_->grad);
  } else {
    d_input = dh;
  }
  ctx = Ctx{};
  return d_input;
}

Tensor GPTModel::logits(const Tensor& tokens) {
  MC_CHECK(stage_.has_embedding && stage_.has_head && stage_.first_layer == 0 && stage_.end_layer == cfg_.num_layers,
           "GPTModel::logits needs the whole model (one pipeline stage)");
  Ctx ctx;
  Tensor h = decoder_forward(embed(tokens, ctx), false, 0, ctx);
  return head_.forward(h, ctx.head);
}

}  // namespace moecore
