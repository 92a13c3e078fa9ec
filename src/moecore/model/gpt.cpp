#include "moecore/model/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "moecore/core/env_switches.h"
#include "moecore/core/memory_categories.h"
#include "moecore/core/step_timers.h"
#include "moecore/ops/common.h"
#include "moecore/ops/cross_entropy.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/embedding.h"
#include "moecore/ops/reduce.h"

namespace moecore {

namespace {
// MOECORE_FUSED_HEAD_ROWS: rows per chunk of the fused output layer (tests, tuning); 0 or unset:
// the default from kFusedHeadChunkElements.
int64_t fused_head_rows_from_environment() {
  const char* env = env_switch("MOECORE_FUSED_HEAD_ROWS");
  if (!env || !*env) return 0;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  MC_CHECK(end && *end == '\0' && v >= 0, "MOECORE_FUSED_HEAD_ROWS='", env, "': expected a number of rows >= 0");
  return v;
}
}  // namespace

GPTModel::GPTModel(const ModelConfig& cfg, ParamStore& store, const MoeParallel& par, const PipelineStage& stage,
                   const DenseParallel& dense)
    : cfg_(cfg), stage_(stage), dense_(dense), head_chunk_rows_(fused_head_rows_from_environment()),
      compute_(store.compute_dtype()) {
  const int64_t tp = dense_.tp_size();
  MC_CHECK(cfg.vocab_size % tp == 0, "the vocabulary of ", cfg.vocab_size,
           " tokens does not divide by --tensor-model-parallel-size ", tp,
           " (moecore does not pad the vocabulary; pick a size that divides it)");
  vocab_start_ = cfg.vocab_size / tp * dense_.tp_rank();
  const LinearSplit vocab_split{tp > 1 ? LinearSplit::Column : LinearSplit::None, tp, dense_.tp_rank(), false};
  // Sequence parallelism: a replicated parameter that sees this rank's tokens only.
  auto sequence_parallel = [&](std::initializer_list<Param*> ps) {
    for (Param* p : ps)
      if (p && dense_.sp()) p->tp_partial_grad = true;
  };
  MoeParallel moe_par = par;
  moe_par.dense = dense_;
  if (stage_.end_layer < 0) stage_.end_layer = cfg.num_layers;
  MC_CHECK(stage_.first_layer >= 0 && stage_.first_layer <= stage_.end_layer && stage_.end_layer <= cfg.num_layers,
           "pipeline stage layers [", stage_.first_layer, ", ", stage_.end_layer, ") are outside [0, ", cfg.num_layers, ")");
  if (store.master_dtype() == DType::F64) compute_ = DType::F64;
  offload_ = parse_offload_modules(cfg.offload_modules);
  const int64_t h = cfg.hidden_size;
  const double std = cfg.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  // Tied embeddings (or MTP): the last pipeline stage keeps its own copy for the output layer or
  // the MTP modules (same name, so the same Philox draw; the trainer sums both copies' gradients
  // over the embedding group).
  if (stage_.has_embedding || (stage_.has_head && cfg.head_stage_has_embedding())) {
    word_embeddings_ = &store.add("embedding.word_embeddings.weight", {cfg.vocab_size / tp, h}, Init::Normal, std, true);
    word_embeddings_->part_size = tp;  // this rank's vocabulary rows
    word_embeddings_->part_rank = dense_.tp_rank();
    word_embeddings_->part_dim = 0;
  }
  if (stage_.has_embedding && cfg.position_embedding_type == "learned_absolute") {
    position_embeddings_ = &store.add("embedding.position_embeddings.weight", {cfg.max_position_embeddings, h},
                                      Init::Normal, std, true);
    sequence_parallel({position_embeddings_});  // added after the sequence split
  }
  // Every layer has a slot (indexed by its global number); only this stage's are built.
  attn_norm_.resize(static_cast<size_t>(cfg.num_layers));
  mlp_norm_.resize(static_cast<size_t>(cfg.num_layers));
  attention_.resize(static_cast<size_t>(cfg.num_layers));
  mla_.resize(static_cast<size_t>(cfg.num_layers));
  mlp_.resize(static_cast<size_t>(cfg.num_layers));
  moe_.resize(static_cast<size_t>(cfg.num_layers));
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i) {
    const size_t li = static_cast<size_t>(i);
    const std::string p = "decoder.layers." + std::to_string(i);
    attn_norm_[li] = Norm(store, p + ".input_layernorm", h, cfg.rmsnorm, cfg.norm_epsilon);
    if (cfg.mla.enabled) {
      mla_[li] = MlaAttention(store, p + ".self_attention", cfg, dense_);
    } else {
      attention_[li] = AttentionBlock(store, p + ".self_attention", cfg, dense_);
    }
    mlp_norm_[li] = Norm(store, p + ".pre_mlp_layernorm", h, cfg.rmsnorm, cfg.norm_epsilon);
    sequence_parallel({attn_norm_[li].weight, attn_norm_[li].bias, mlp_norm_[li].weight, mlp_norm_[li].bias});
    if (cfg.is_moe(i)) {
      MC_CHECK(tp == 1 || dense_.sp(), "MoE layers with --tensor-model-parallel-size ", tp,
               " need --sequence-parallel (as in Megatron-Core)");
      moe_[li] = MoeLayer(store, p + ".mlp", cfg, moe_par);
    } else {
      mlp_[li] = Mlp(store, p + ".mlp", h, cfg.ffn_hidden_size, cfg.swiglu, cfg.add_bias_linear, std, out_std, dense_);
    }
  }
  if (stage_.has_head) {
    final_norm_ = Norm(store, "decoder.final_layernorm", h, cfg.rmsnorm, cfg.norm_epsilon);
    sequence_parallel({final_norm_.weight, final_norm_.bias});
    head_ = Linear(store, "output_layer", h, cfg.vocab_size, false, std, cfg.untie_embeddings ? nullptr : word_embeddings_,
                   vocab_split, /*fp8_eligible=*/false);  // the output layer stays out of FP8, as in Megatron
    for (int64_t k = 0; k < cfg.mtp_num_layers; ++k)
      mtp_.emplace_back(store, "mtp.layers." + std::to_string(k), cfg, moe_par, dense_);
  }
}

Tensor GPTModel::attention_forward(size_t i, const Tensor& x, int64_t batch, LayerCtx& lc) const {
  return cfg_.mla.enabled ? mla_[i].forward(x, batch, lc.mla) : attention_[i].forward(x, batch, lc.attn);
}

Tensor GPTModel::attention_backward(size_t i, const Tensor& dy, int64_t batch, LayerCtx& lc) const {
  return cfg_.mla.enabled ? mla_[i].backward(dy, batch, lc.mla) : attention_[i].backward(dy, batch, lc.attn);
}

std::vector<MoeLayer*> GPTModel::moe_layers() {
  std::vector<MoeLayer*> out;
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i)
    if (cfg_.is_moe(i)) out.push_back(&moe_[static_cast<size_t>(i)]);
  for (MtpLayer& m : mtp_)
    if (m.moe_layer()) out.push_back(m.moe_layer());
  return out;
}

std::vector<int64_t> GPTModel::moe_layer_numbers() const {
  std::vector<int64_t> out;
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i)
    if (cfg_.is_moe(i)) out.push_back(i);
  for (int64_t k = 0; k < static_cast<int64_t>(mtp_.size()); ++k)
    if (cfg_.is_moe(cfg_.num_layers - 1)) out.push_back(cfg_.num_layers + k);
  return out;
}

bool fused_head_enabled() {
  const char* env = env_switch("MOECORE_FUSED_HEAD");
  return !(env && std::strcmp(env, "0") == 0);
}


Tensor GPTModel::embed(const Tensor& tokens, Ctx& ctx) {
  MC_CHECK(tokens.ndim() == 2 && tokens.dtype() == DType::I32, "model input must be [batch, seq] i32, got ",
           tokens.describe());
  const int64_t batch = tokens.size(0), seq = tokens.size(1), n = batch * seq;
  MC_CHECK(seq * dense_.cp_size() <= cfg_.max_position_embeddings, "sequence of ", seq * dense_.cp_size(),
           " tokens exceeds --max-position-embeddings ", cfg_.max_position_embeddings);
  ctx.batch = batch;
  ctx.token_ids = tokens.view({n});
  wait_params(-1);
  Tensor x = Tensor::empty({n, cfg_.hidden_size}, compute_, tokens.device());
  if (dense_.tp) {
    // This rank's vocabulary rows (zeros for the other tokens), summed over TP by the exit region.
    ops::embedding_forward(word_embeddings_->weight, ctx.token_ids, x, vocab_start_, cfg_.vocab_size);
    x = dense_.exit_forward(x, batch);
  } else {
    ops::embedding_forward(word_embeddings_->weight, ctx.token_ids, x);
  }
  if (position_embeddings_) {
    const std::vector<int32_t> pos = dense_.token_positions(batch, seq);
    ctx.position_ids = Tensor::from_vector(pos, {static_cast<int64_t>(pos.size())}, tokens.device());
    Tensor p = Tensor::empty(x.shape(), compute_, tokens.device());
    ops::embedding_forward(position_embeddings_->weight, ctx.position_ids, p);
    add_into(x, p);
  }
  return x;
}

Tensor GPTModel::layer_attention_forward(size_t li, Tensor h, bool training, int64_t batch, LayerCtx& lc,
                                         bool recomputing) {
  // New tensors for the residual stream: the norms keep their inputs for the backward.
  // Memory accounting: each module's saved tensors under its name (core/memory_categories.h).
  const TimedRegion timed("attention-forward", 2, h.device());
  std::optional<MemoryCategoryScope> module(std::in_place, ActivationModule::kAttnNorm);
  const Tensor normed = attn_norm_[li].forward(h, lc.attn_norm);
  module.emplace(ActivationModule::kCoreAttn);
  const Tensor attn = attention_forward(li, normed, batch, lc);
  module.emplace(ActivationModule::kResidual);
  h = add_tensors(h, attn);
  if (releases_norm_outputs(training, recomputing, lc)) release_norm_output(normed, lc.attn_normed);
  return h;
}

Tensor GPTModel::layer_forward(int64_t i, Tensor h, bool training, uint64_t rng_seed, int64_t batch, LayerCtx& lc,
                              bool recomputing) {
  const size_t li = static_cast<size_t>(i);
  h = layer_attention_forward(li, h, training, batch, lc, recomputing);
  std::optional<MemoryCategoryScope> module(std::in_place, ActivationModule::kMlpNorm);
  if (cfg_.is_moe(i)) {
    const TimedRegion timed("moe-forward", 2, h.device());
    const Tensor normed = mlp_norm_[li].forward(h, lc.mlp_norm);
    module.reset();  // the MoE layer names its parts
    const Tensor moe = recomputing ? moe_[li].recompute(normed, lc.moe)
                                   : moe_[li].forward(normed, batch, training,
                                                      rng_seed + 0x9E3779B97F4A7C15ull * (li + 1), lc.moe);
    module.emplace(ActivationModule::kResidual);
    h = add_tensors(h, moe);
    if (releases_norm_outputs(training, recomputing, lc)) release_norm_output(normed, lc.mlp_normed);
    if (recomputing) return h;
    if (training && cfg_.recompute.moe) {
      moe_[li].drop_for_recompute(lc.moe, true);
      lc.moe_dropped = true;
    }
  } else {
    const TimedRegion timed("mlp-forward", 2, h.device());
    const Tensor normed = mlp_norm_[li].forward(h, lc.mlp_norm);
    module.emplace(ActivationModule::kMlp);
    const Tensor mlp = mlp_[li].forward(normed, lc.mlp, batch);
    module.emplace(ActivationModule::kResidual);
    h = add_tensors(h, mlp);
    if (training && !recomputing && cfg_.recompute.mlp) {
      lc.mlp = Mlp::Ctx{};
      lc.mlp_input = normed;
    }
    if (releases_norm_outputs(training, recomputing, lc)) release_norm_output(normed, lc.mlp_normed);
  }
  return h;
}

int64_t GPTModel::full_recompute_first(int64_t i) const {
  const int64_t n = cfg_.recompute.full_num_layers, offset = i - stage_.first_layer;
  if (cfg_.recompute.full_method == "uniform") return stage_.first_layer + offset / n * n;
  if (cfg_.recompute.full_method == "block") return offset < n ? i : -1;
  return -1;
}

Tensor GPTModel::decoder_forward(Tensor h, bool training, uint64_t rng_seed, Ctx& ctx) {
  ctx.layers.resize(static_cast<size_t>(cfg_.num_layers));
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i) {
    LayerCtx& lc = ctx.layers[static_cast<size_t>(i)];
    wait_params(i);
    lc.recompute_first = training ? full_recompute_first(i) : -1;
    lc.recompute_input = lc.recompute_first == i ? h : Tensor();
    lc.mlp_input = Tensor();
    lc.moe_dropped = false;
    h = layer_forward(i, h, training, rng_seed, ctx.batch, lc, false);
    if (lc.recompute_first >= 0) {  // --recompute-granularity full: keep only the router's
      lc.attn_norm = lc.mlp_norm = Norm::Ctx{};
      lc.attn = AttentionBlock::Ctx{};
      lc.mla = MlaAttention::Ctx{};
      lc.mlp = Mlp::Ctx{};
      lc.mlp_input = Tensor();
      if (cfg_.is_moe(i)) moe_[static_cast<size_t>(i)].drop_for_recompute(lc.moe, false);
      lc.moe_dropped = false;
    }
    if (training && offload_.any()) offload_layer(i, ctx, h.device());
  }
  return h;
}

void GPTModel::recompute_layers(int64_t first, int64_t last, Ctx& ctx) {
  const TimedRegion timed("recompute-forward", 2, ctx.layers[static_cast<size_t>(first)].recompute_input.device());
  Tensor h = ctx.layers[static_cast<size_t>(first)].recompute_input;
  ctx.layers[static_cast<size_t>(first)].recompute_input = Tensor();
  for (int64_t j = first; j <= last; ++j) {
    LayerCtx& lc = ctx.layers[static_cast<size_t>(j)];
    h = layer_forward(j, h, true, 0, ctx.batch, lc, true);
    lc.recompute_first = -1;
  }
}

bool GPTModel::releases_norm_outputs(bool training, bool recomputing, const LayerCtx& lc) const {
  // Not for a layer that full recomputation reruns whole (its saved tensors are dropped anyway).
  return training && !recomputing && cfg_.recompute.layernorm && lc.recompute_first < 0;
}

void GPTModel::release_norm_output(const Tensor& normed, Tensor& kept) {
  kept = normed;
  kept.release_storage();
}

void GPTModel::recompute_norm_output(const Norm& norm, const Norm::Ctx& norm_ctx, Tensor& kept, ActivationModule module) {
  if (!kept.defined()) return;
  const TimedRegion timed("recompute-forward", 2, kept.device());
  const MemoryCategoryScope scope(module);  // saved again, under the norm's name
  kept.reacquire_storage();
  Norm::Ctx again;  // the same input and weights: the forward's bits
  kept.copy_from(norm.forward(norm_ctx.x, again));
  kept = Tensor();
}

void GPTModel::recompute_before_backward(int64_t i, Ctx& ctx) {
  LayerCtx& lc = ctx.layers[static_cast<size_t>(i)];
  if (lc.recompute_first >= 0) recompute_layers(lc.recompute_first, i, ctx);
  // Before the MoE / MLP reruns below, which read it (the attention norm's comes before attention's backward).
  recompute_norm_output(mlp_norm_[static_cast<size_t>(i)], lc.mlp_norm, lc.mlp_normed, ActivationModule::kMlpNorm);
  if (lc.moe_dropped) {
    const TimedRegion timed("recompute-forward", 2, lc.moe.x.device());
    moe_[static_cast<size_t>(i)].recompute(Tensor(), lc.moe);
    lc.moe_dropped = false;
  }
  if (lc.mlp_input.defined()) {
    const TimedRegion timed("recompute-forward", 2, lc.mlp_input.device());
    const MemoryCategoryScope module(ActivationModule::kMlp);  // saved again, under its name
    mlp_[static_cast<size_t>(i)].forward(lc.mlp_input, lc.mlp, ctx.batch);
    lc.mlp_input = Tensor();
  }
}

void GPTModel::loss_rows(const Tensor& logits, const Tensor& labels, Tensor& loss, Tensor& lse) const {
  if (!dense_.tp) {
    ops::cross_entropy_forward(logits, labels, loss, lse);
    return;
  }
  // Vocabulary-parallel: each rank's logsumexp and target logit, combined over TP.
  comm::Communicator& tp = *dense_.tp;
  const int64_t n = logits.size(0);
  const DType stat = lse.dtype();
  const Device dev = logits.device();
  Tensor lse_part = Tensor::empty({n}, stat, dev), target_logit = Tensor::empty({n}, stat, dev);
  ops::cross_entropy_part_forward(logits, labels, vocab_start_, cfg_.vocab_size, lse_part, target_logit);
  Tensor parts = Tensor::empty({tp.size() * n}, stat, dev);
  tp.all_gather(lse_part, parts);
  tp.all_reduce(target_logit, comm::ReduceOp::Sum);
  ops::logsumexp_combine(parts.view({tp.size(), n}), lse);
  ops::cross_entropy_combined_loss(lse, target_logit, labels, loss);
}

void GPTModel::loss_rows_backward(Tensor& logits, const Tensor& labels, const Tensor& lse, double dloss_value) const {
  Tensor dloss = Tensor::empty({logits.size(0)}, lse.dtype(), logits.device());
  ops::fill(dloss, dloss_value);
  if (dense_.tp) {  // in place; the one-hot only where the target is in this rank's rows
    ops::cross_entropy_backward(logits, labels, lse, dloss, logits, vocab_start_, cfg_.vocab_size);
  } else {
    ops::cross_entropy_backward(logits, labels, lse, dloss, logits);
  }
}

namespace {

// " (sample b, position s)" of flat index i in rows of seq tokens; nothing for seq = 0.
std::string sample_position(size_t i, int64_t seq) {
  if (seq <= 0) return "";
  const size_t s = static_cast<size_t>(seq);
  return " (sample " + std::to_string(i / s) + ", position " + std::to_string(i % s) + ")";
}

// Labelled tokens of labels[0, n), each checked against the vocabulary (negative: ignored);
// seq > 0: the labels are rows of seq tokens, named in the error.
int64_t count_checked_labels(const int32_t* labels, size_t n, int64_t vocab_size, int64_t seq = 0) {
  int64_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    MC_CHECK(labels[i] < vocab_size, "labels[", i, "]", sample_position(i, seq), " = ", labels[i],
             " is out of range for the vocabulary of ", vocab_size, " (expected < ", vocab_size,
             ", or negative to ignore the token)");
    count += labels[i] >= 0 ? 1 : 0;
  }
  return count;
}

}  // namespace

int64_t check_batch_on_host(const Tensor& tokens, const Tensor& labels, int64_t vocab_size) {
  MC_CHECK(tokens.device().is_cpu() && labels.device().is_cpu() && tokens.is_contiguous() && labels.is_contiguous() &&
               tokens.dtype() == DType::I32 && labels.dtype() == DType::I32 && tokens.ndim() == 2 &&
               labels.shape() == tokens.shape(),
           "check_batch_on_host: tokens and labels must be [batch, seq] i32 on the host, got ", tokens.describe(),
           " and ", labels.describe());
  const int32_t* t = tokens.data<int32_t>();
  const int64_t seq = tokens.size(1);
  for (int64_t i = 0; i < tokens.numel(); ++i)
    MC_CHECK(t[i] >= 0 && t[i] < vocab_size, "tokens[", i, "]", sample_position(static_cast<size_t>(i), seq), " = ",
             t[i], " is out of range for the vocabulary of ", vocab_size, " (expected 0 <= token < ", vocab_size,
             "; --vocab-size smaller than the tokenizer's?)");
  return count_checked_labels(labels.data<int32_t>(), static_cast<size_t>(labels.numel()), vocab_size, seq);
}

void GPTModel::count_labels(Ctx& ctx) const {
  if (ctx.checked_num_labels >= 0) {
    ctx.num_labels = ctx.checked_num_labels;
    return;
  }
  // Checked here, on the host, so the loss ops need not synchronise for their own range check
  // (they run inside ops::TargetsValidated).
  const std::vector<int32_t> labels = ctx.labels.to_vector<int32_t>();
  ctx.num_labels = count_checked_labels(labels.data(), labels.size(), cfg_.vocab_size, ctx.label_seq);
  if (dense_.cp) {  // this rank holds its chunks of the sequences: the whole sequences' count
    std::vector<double> v = {static_cast<double>(ctx.num_labels)};
    comm::all_reduce_host(*dense_.cp, v);
    ctx.num_labels = static_cast<int64_t>(v[0] + 0.5);
  }
}

Tensor GPTModel::head_forward(const Tensor& h, Ctx& ctx) {
  const Tensor x = dense_.enter_forward(h, ctx.batch);  // every token of the (CP-local) sequences
  const int64_t n = x.size(0);
  ctx.logits = head_.forward(x, ctx.head);
  const DType stat = compute_ == DType::F64 ? DType::F64 : DType::F32;
  Tensor loss = Tensor::empty({n}, stat, h.device());
  ctx.lse = Tensor::empty({n}, stat, h.device());
  count_labels(ctx);
  const ops::TargetsValidated checked;
  loss_rows(ctx.logits, ctx.labels, loss, ctx.lse);
  Tensor total = Tensor::empty({1}, stat, h.device());
  ops::sum_all(loss, total);
  return total;
}

Tensor GPTModel::head_forward_chunked(const Tensor& h, double grad_scale, Ctx& ctx) {
  const Tensor x = dense_.enter_forward(h, ctx.batch);
  const int64_t n = x.size(0);
  const DType stat = compute_ == DType::F64 ? DType::F64 : DType::F32;
  const Device dev = h.device();
  const bool backward = grad_scale > 0;
  count_labels(ctx);  // the gradient of the mean needs the whole sequences' label count first
  const int64_t labelled = ctx.num_labels;
  ctx.fused_head_scale = grad_scale;
  const double dloss = labelled > 0 ? grad_scale / static_cast<double>(labelled) : 0.0;
  const int64_t chunk =
      head_chunk_rows_ > 0 ? head_chunk_rows_ : std::max<int64_t>(1, kFusedHeadChunkElements / std::max<int64_t>(1, head_.out));
  Tensor loss = Tensor::empty({n}, stat, dev);
  Tensor dx = backward ? Tensor::empty(x.shape(), x.dtype(), dev) : Tensor();
  // Without TP the loss and its gradient come from one pass over each chunk's logits.
  Tensor dloss_rows;
  if (backward && !dense_.tp) {
    dloss_rows = Tensor::empty({std::min(n, chunk)}, stat, dev);
    ops::fill(dloss_rows, dloss);
  }
  const ops::TargetsValidated checked;  // count_labels checked them
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t r1 = std::min(n, r0 + chunk);
    const Tensor labels = ctx.labels.slice(0, r0, r1);
    Linear::Ctx head_ctx;
    Tensor logits = head_.forward(x.slice(0, r0, r1), head_ctx);
    Tensor lse = Tensor::empty({r1 - r0}, stat, dev);
    Tensor loss_rows_out = loss.slice(0, r0, r1);
    if (dloss_rows.defined()) {
      ops::cross_entropy_forward_backward(logits, labels, dloss_rows.slice(0, 0, r1 - r0), loss_rows_out, lse, logits);
    } else {
      loss_rows(logits, labels, loss_rows_out, lse);
      if (!backward) continue;
      loss_rows_backward(logits, labels, lse, dloss);
    }
    dx.slice(0, r0, r1).copy_from(head_.backward(logits, head_ctx));  // dW accumulates here
  }
  if (backward) ctx.d_head_input = dense_.enter_backward(dx, ctx.batch);
  Tensor total = Tensor::empty({1}, stat, dev);
  ops::sum_all(loss, total);
  return total;
}

double GPTModel::forward(const Tensor& tokens, const Tensor& labels, bool training, uint64_t rng_seed, Ctx& ctx,
                         const Tensor& hidden_in) {
  const Tensor sum = forward_loss_sum(tokens, labels, training, rng_seed, ctx, hidden_in);
  if (!sum.defined()) return 0.0;
  const double value = sum.dtype() == DType::F64 ? sum.to_vector<double>()[0] : sum.to_vector<float>()[0];
  return ctx.num_labels > 0 ? value / static_cast<double>(ctx.num_labels) : 0.0;
}

Tensor GPTModel::forward_loss_sum(const Tensor& tokens, const Tensor& labels, bool training, uint64_t rng_seed,
                                  Ctx& ctx, const Tensor& hidden_in) {
  const MemoryCategoryScope activations(MemoryCategory::kActivations);  // what no module below names
  const OffloadForwardEnd offload_end(offloader_);  // --offload-modules: the last layer's device copies go
  Tensor h = decoder_forward(forward_input(tokens, labels, ctx, hidden_in), training, rng_seed, ctx);
  return forward_output(h, tokens, labels, training, rng_seed, ctx);
}

Tensor GPTModel::forward_input(const Tensor& tokens, const Tensor& labels, Ctx& ctx, const Tensor& hidden_in) {
  MC_CHECK(labels.shape() == tokens.shape() && labels.dtype() == DType::I32, "labels must match tokens ",
           tokens.describe(), ", got ", labels.describe());
  if (stage_.has_embedding) {
    const TimedRegion timed("embedding-forward", 2, tokens.device());
    const MemoryCategoryScope module(ActivationModule::kEmbedding);
    std::optional<ops::EmbeddingIdsValidated> checked;  // check_batch_on_host checked the tokens
    if (ctx.checked_num_labels >= 0) checked.emplace();
    return embed(tokens, ctx);
  }
  const int64_t rows = hidden_rows(tokens);
  MC_CHECK(hidden_in.defined() && hidden_in.ndim() == 2 && hidden_in.size(0) == rows &&
               hidden_in.size(1) == cfg_.hidden_size,
           "pipeline stage input must be [", rows, ", ", cfg_.hidden_size, "], got ",
           hidden_in.defined() ? hidden_in.describe() : std::string("nothing"));
  ctx.batch = tokens.size(0);
  return hidden_in;
}

Tensor GPTModel::forward_output(Tensor h, const Tensor& tokens, const Tensor& labels, bool training,
                                uint64_t rng_seed, Ctx& ctx) {
  if (!stage_.has_head) {
    ctx.hidden_out = h;
    ctx.num_labels = 0;
    return Tensor();
  }
  const Tensor decoder_out = h;  // the MTP modules' input
  Tensor sum;
  {
    // With the fused output layer (training) this region holds the output layer's backward too.
    const TimedRegion timed("output-layer", 2, h.device());
    wait_params(cfg_.num_layers);
    std::optional<MemoryCategoryScope> module(std::in_place, ActivationModule::kFinalNorm);
    h = final_norm_.forward(h, ctx.final_norm);
    module.emplace(ActivationModule::kOutputLayer);
    ctx.labels = labels.view({labels.numel()});
    ctx.label_seq = !dense_.cp && labels.ndim() == 2 ? labels.size(1) : 0;  // CP: this rank's chunks only
    // Training with fused_head_scale: loss and backward chunk by chunk; evaluation: the loss chunk
    // by chunk (no backward will come); MOECORE_FUSED_HEAD=0: the plain path (logits kept).
    const bool chunked = fused_head_enabled() && (!training || ctx.fused_head_scale > 0);
    sum = chunked ? head_forward_chunked(h, training ? ctx.fused_head_scale : 0.0, ctx) : head_forward(h, ctx);
    if (!chunked || !training) ctx.fused_head_scale = 0;
    if (dense_.cp) dense_.cp->all_reduce(sum, comm::ReduceOp::Sum);  // the whole sequences' loss, on the device
  }
  if (training && !mtp_.empty()) {
    const MemoryCategoryScope module(ActivationModule::kMtp);
    mtp_forward(decoder_out, tokens, labels, rng_seed, ctx);
  }
  return sum;
}

Tensor GPTModel::head_backward(double grad_scale, Ctx& ctx) {
  return final_norm_.backward(head_input_grad(grad_scale, ctx), ctx.final_norm);
}

Tensor GPTModel::head_input_grad(double grad_scale, Ctx& ctx) {
  if (ctx.d_head_input.defined()) {  // fused: the output layer's backward ran in the forward
    MC_CHECK(grad_scale == ctx.fused_head_scale, "GPTModel::backward: grad_scale ", grad_scale,
             " differs from the fused output layer's ", ctx.fused_head_scale, " given before the forward");
    const Tensor dx = ctx.d_head_input;
    ctx.d_head_input = Tensor();
    return dx;
  }
  MC_CHECK(ctx.logits.defined(), "GPTModel::backward without a forward");
  const ops::TargetsValidated checked;  // count_labels checked them in the forward
  loss_rows_backward(ctx.logits, ctx.labels, ctx.lse,
                     ctx.num_labels > 0 ? grad_scale / static_cast<double>(ctx.num_labels) : 0.0);
  const Tensor dx = dense_.enter_backward(head_.backward(ctx.logits, ctx.head), ctx.batch);
  ctx.logits = ctx.lse = Tensor();
  return dx;
}

Tensor GPTModel::embed_words(const Tensor& ids, int64_t batch) const {
  Tensor x = Tensor::empty({ids.numel(), cfg_.hidden_size}, compute_, ids.device());
  if (!dense_.tp) {
    ops::embedding_forward(word_embeddings_->weight, ids, x);
    return x;
  }
  ops::embedding_forward(word_embeddings_->weight, ids, x, vocab_start_, cfg_.vocab_size);
  return dense_.exit_forward(x, batch);
}

void GPTModel::embed_words_backward(const Tensor& ids, const Tensor& dx, int64_t batch) const {
  if (!dense_.tp) {
    ops::embedding_backward(ids, dx, word_embeddings_->grad_to_accumulate());
    return;
  }
  ops::embedding_backward(ids, dense_.exit_backward(dx, batch), word_embeddings_->grad_to_accumulate(), vocab_start_,
                          cfg_.vocab_size);
}

void GPTModel::mtp_forward(const Tensor& h0, const Tensor& tokens, const Tensor& labels, uint64_t rng_seed, Ctx& ctx) {
  const TimedRegion timed("mtp-forward", 2, h0.device());
  const int64_t depths = static_cast<int64_t>(mtp_.size());
  MC_CHECK(word_embeddings_, "multi-token prediction: the stage with the output layer lacks the word embedding");
  if (ctx.mtp_inputs.empty()) {  // built here from the whole sequences (one read of each)
    MC_CHECK(!dense_.cp, "multi-token prediction under context parallelism needs Ctx::mtp_inputs from the whole "
             "sequences (make_mtp_batch before the split)");
    const MtpBatch host = make_mtp_batch(tokens.to(Device::cpu()).contiguous(), labels.to(Device::cpu()).contiguous(),
                                         depths);
    ctx.mtp_inputs.num_labels = host.num_labels;
    for (int64_t k = 0; k < depths; ++k) {
      ctx.mtp_inputs.tokens.push_back(host.tokens[static_cast<size_t>(k)].to(tokens.device()));
      ctx.mtp_inputs.labels.push_back(host.labels[static_cast<size_t>(k)].to(tokens.device()));
    }
  }
  const MtpBatch& in = ctx.mtp_inputs;
  MC_CHECK(static_cast<int64_t>(in.tokens.size()) == depths && static_cast<int64_t>(in.labels.size()) == depths &&
               static_cast<int64_t>(in.num_labels.size()) == depths,
           "multi-token prediction: Ctx::mtp_inputs holds ", in.tokens.size(), " depths, the model has ", depths);
  const double per_depth = cfg_.mtp_loss_scaling_factor / static_cast<double>(depths);
  ctx.mtp_layers.assign(static_cast<size_t>(depths), MtpLayer::Ctx{});
  ctx.mtp_heads.assign(static_cast<size_t>(depths), Ctx{});
  ctx.mtp_loss_sums.assign(static_cast<size_t>(depths), Tensor());
  ctx.mtp_num_labels = in.num_labels;
  // The shifted ids are the checked tokens and labels moved (the filler 0 and -1 are in range).
  const ops::EmbeddingIdsValidated ids_checked;
  const ops::TargetsValidated targets_checked;
  Tensor h = h0;
  for (int64_t k = 0; k < depths; ++k) {
    const size_t kk = static_cast<size_t>(k);
    const Tensor& ids = in.tokens[kk];
    MC_CHECK(ids.shape() == tokens.shape() && in.labels[kk].shape() == tokens.shape(), "multi-token prediction: depth ",
             k + 1, "'s tokens ", ids.describe(), " and labels ", in.labels[kk].describe(), " must match the tokens ",
             tokens.describe());
    const Tensor emb = embed_words(ids.view({ids.numel()}), ctx.batch);
    h = mtp_[kk].forward(h, emb, ctx.batch, true, rng_seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(cfg_.num_layers + k + 1),
                         ctx.mtp_layers[kk]);
    const Tensor normed = mtp_[kk].final_norm.forward(h, ctx.mtp_layers[kk].final_norm);
    Ctx& head = ctx.mtp_heads[kk];
    head.batch = ctx.batch;
    head.labels = in.labels[kk].view({in.labels[kk].numel()});
    head.checked_num_labels = in.num_labels[kk];
    const double scale = ctx.fused_head_scale * per_depth;
    Tensor sum = fused_head_enabled() && scale > 0 ? head_forward_chunked(normed, scale, head) : head_forward(normed, head);
    if (dense_.cp) dense_.cp->all_reduce(sum, comm::ReduceOp::Sum);
    ctx.mtp_loss_sums[kk] = sum;
  }
}

Tensor GPTModel::mtp_backward(double grad_scale, Ctx& ctx) {
  const TimedRegion timed("mtp-backward", 2, ctx.labels.device());
  const int64_t depths = static_cast<int64_t>(mtp_.size());
  MC_CHECK(static_cast<int64_t>(ctx.mtp_layers.size()) == depths, "GPTModel::backward: the MTP forward ran ",
           ctx.mtp_layers.size(), " depths, the model has ", depths);
  const double per_depth = cfg_.mtp_loss_scaling_factor / static_cast<double>(depths);
  const ops::EmbeddingIdsValidated ids_checked;  // the forward's embedding read these ids
  const ops::TargetsValidated targets_checked;
  Tensor d_next;  // the gradient of this depth's output from the next depth
  for (int64_t k = depths - 1; k >= 0; --k) {
    const size_t kk = static_cast<size_t>(k);
    MtpLayer::Ctx& lc = ctx.mtp_layers[kk];
    Tensor dh = mtp_[kk].final_norm.backward(head_input_grad(grad_scale * per_depth, ctx.mtp_heads[kk]), lc.final_norm);
    if (d_next.defined()) add_into(dh, d_next);
    Tensor d_prev, d_emb;
    mtp_[kk].backward(dh, grad_scale, lc, d_prev, d_emb);
    const Tensor& ids = ctx.mtp_inputs.tokens[kk];
    embed_words_backward(ids.view({ids.numel()}), d_emb, ctx.batch);
    d_next = d_prev;
  }
  return d_next;
}

Tensor GPTModel::backward(double grad_scale, Ctx& ctx, const std::function<void(int64_t)>& layer_done,
                          const Tensor& d_hidden_out) {
  const MemoryCategoryScope workspace(MemoryCategory::kWorkspace);  // activation gradients, temporaries
  if (offloader_) offloader_->begin_backward(ctx.offload_stash);  // the highest offloaded layer comes back
  Tensor dh = backward_output(grad_scale, ctx, d_hidden_out);
  for (int64_t i = stage_.end_layer - 1; i >= stage_.first_layer; --i) {
    const size_t li = static_cast<size_t>(i);
    reload_layer(i, ctx);
    recompute_before_backward(i, ctx);
    LayerCtx& lc = ctx.layers[li];
    {
      const TimedRegion timed(cfg_.is_moe(i) ? "moe-backward" : "mlp-backward", 2, dh.device());
      Tensor d_normed = cfg_.is_moe(i) ? moe_[li].backward(dh, grad_scale, lc.moe) : mlp_[li].backward(dh, lc.mlp);
      add_into(dh, mlp_norm_[li].backward(d_normed, lc.mlp_norm));
    }
    layer_attention_backward(li, dh, ctx);
    if (layer_done) layer_done(i);
  }
  return backward_input(dh, ctx);
}

Tensor GPTModel::backward_output(double grad_scale, Ctx& ctx, const Tensor& d_hidden_out) {
  Tensor dh;
  if (stage_.has_head) {
    {
      const TimedRegion timed("output-layer-backward", 2, ctx.labels.device());
      dh = head_backward(grad_scale, ctx);
    }
    if (!ctx.mtp_layers.empty()) add_into(dh, mtp_backward(grad_scale, ctx));
  } else {
    MC_CHECK(ctx.hidden_out.defined() && d_hidden_out.defined() && d_hidden_out.shape() == ctx.hidden_out.shape(),
             "pipeline stage backward needs the gradient of its output ", ctx.hidden_out.describe());
    dh = d_hidden_out.clone();  // accumulated into below
    ctx.hidden_out = Tensor();
  }
  return dh;
}

void GPTModel::layer_attention_backward(size_t li, Tensor& dh, Ctx& ctx) {
  LayerCtx& lc = ctx.layers[li];
  recompute_norm_output(attn_norm_[li], lc.attn_norm, lc.attn_normed, ActivationModule::kAttnNorm);
  const TimedRegion timed("attention-backward", 2, dh.device());
  add_into(dh, attn_norm_[li].backward(attention_backward(li, dh, ctx.batch, lc), lc.attn_norm));
}

Tensor GPTModel::backward_input(const Tensor& dh, Ctx& ctx) {
  Tensor d_input;
  if (stage_.has_embedding) {
    const TimedRegion timed("embedding-backward", 2, dh.device());
    const ops::EmbeddingIdsValidated checked;  // the forward's embedding checked these ids
    if (position_embeddings_) ops::embedding_backward(ctx.position_ids, dh, position_embeddings_->grad_to_accumulate());
    if (dense_.tp) {
      ops::embedding_backward(ctx.token_ids, dense_.exit_backward(dh, ctx.batch), word_embeddings_->grad_to_accumulate(), vocab_start_,
                              cfg_.vocab_size);
    } else {
      ops::embedding_backward(ctx.token_ids, dh, word_embeddings_->grad_to_accumulate());
    }
  } else {
    d_input = dh;
  }
  ctx = Ctx{};
  return d_input;
}

Tensor GPTModel::logits(const Tensor& tokens) {
  MC_CHECK(stage_.has_embedding && stage_.has_head && stage_.first_layer == 0 && stage_.end_layer == cfg_.num_layers &&
               !dense_.tp && !dense_.cp,
           "GPTModel::logits needs the whole model (one pipeline stage, no tensor or context parallelism)");
  Ctx ctx;
  Tensor h = decoder_forward(embed(tokens, ctx), false, 0, ctx);
  wait_params(cfg_.num_layers);
  return head_.forward(final_norm_.forward(h, ctx.final_norm), ctx.head);
}

GPTModel::KvCache GPTModel::make_kv_cache(int64_t rows, int64_t max_len, Device device) const {
  MC_CHECK(stage_.has_embedding && stage_.has_head && stage_.first_layer == 0 && stage_.end_layer == cfg_.num_layers &&
               !dense_.tp && !dense_.cp,
           "generation with a KV cache needs the whole model on one rank (no pipeline, tensor or context parallelism)");
  MC_CHECK(rows > 0 && max_len > 0, "make_kv_cache: ", rows, " rows of ", max_len, " positions");
  MC_CHECK(!position_embeddings_ || max_len <= cfg_.max_position_embeddings, "generation needs ", max_len,
           " positions; the model's learned position embeddings have ", cfg_.max_position_embeddings);
  KvCache cache;
  cache.rows = rows;
  cache.max_len = max_len;
  for (const AttentionBlock& a : attention_) {
    if (cfg_.mla.enabled) {  // every head's K and V after the up projections
      const int64_t n = cfg_.num_attention_heads;
      cache.k.push_back(Tensor::empty({rows, max_len, n, cfg_.mla.q_head_dim()}, compute_, device));
      cache.v.push_back(Tensor::empty({rows, max_len, n, cfg_.mla.v_head_dim}, compute_, device));
      continue;
    }
    const Shape shape{rows, max_len, a.kv_heads(), a.head_dim()};
    cache.k.push_back(Tensor::empty(shape, compute_, device));
    cache.v.push_back(Tensor::empty(shape, compute_, device));
  }
  return cache;
}

Tensor GPTModel::cached_logits(const Tensor& tokens, int64_t first_row, const std::vector<int64_t>& start,
                               KvCache& cache) {
  const int64_t rows = tokens.size(0), seq = tokens.size(1), n = tokens.numel();
  MC_CHECK(tokens.ndim() == 2 && tokens.dtype() == DType::I32 && (rows == 1 || seq == 1) &&
               static_cast<int64_t>(start.size()) == rows && cache.rows > 0,
           "cached_logits: tokens must be [1, S] or [R, 1] i32 with one start per row, got ", tokens.describe());
  if (seq == 1 && first_row == 0 && rows == cache.rows) {
    // decode_logits trusts its device positions (the CUDA decode attention writes the cache at
    // them unchecked): check them here, as forward_cached does on the other path.
    for (int64_t r = 0; r < rows; ++r)
      MC_CHECK(start[static_cast<size_t>(r)] >= 0 && start[static_cast<size_t>(r)] < cache.max_len, "cached_logits: row ",
               r, " at position ", start[static_cast<size_t>(r)], " is outside the KV cache of ", cache.max_len,
               " positions");
    const std::vector<int32_t> pos(start.begin(), start.end());
    return decode_logits(tokens, Tensor::from_vector(pos, {rows}, tokens.device()), cache);
  }
  Tensor h = Tensor::empty({n, cfg_.hidden_size}, compute_, tokens.device());
  ops::embedding_forward(word_embeddings_->weight, tokens.view({n}), h);
  if (position_embeddings_) {
    std::vector<int32_t> pos;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t s = 0; s < seq; ++s) pos.push_back(static_cast<int32_t>(start[static_cast<size_t>(r)] + s));
    Tensor p = Tensor::empty(h.shape(), compute_, tokens.device());
    ops::embedding_forward(position_embeddings_->weight, Tensor::from_vector(pos, {n}, tokens.device()), p);
    add_into(h, p);
  }
  Tensor positions;  // a decoding step: each row's position on the device, for every layer
  if (seq == 1) {
    std::vector<int32_t> pos(start.begin(), start.end());
    positions = Tensor::from_vector(pos, {rows}, tokens.device());
  }
  for (int64_t i = 0; i < cfg_.num_layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    LayerCtx lc;
    const Tensor normed_in = attn_norm_[li].forward(h, lc.attn_norm);
    h = add_tensors(h, cfg_.mla.enabled
                           ? mla_[li].forward_cached(normed_in, first_row, start, cache.k[li], cache.v[li])
                           : attention_[li].forward_cached(normed_in, first_row, start, positions, cache.k[li],
                                                           cache.v[li]));
    const Tensor normed = mlp_norm_[li].forward(h, lc.mlp_norm);
    h = add_tensors(h, cfg_.is_moe(i) ? moe_[li].forward(normed, rows, false, 0, lc.moe) : mlp_[li].forward(normed, lc.mlp, rows));
  }
  if (seq > 1) h = h.slice(0, n - 1, n);  // one prompt: its last token
  Norm::Ctx norm_ctx;
  Linear::Ctx head_ctx;
  return head_.forward(final_norm_.forward(h, norm_ctx), head_ctx);
}

Tensor GPTModel::decode_logits(const Tensor& tokens, const Tensor& positions, KvCache& cache) {
  const int64_t rows = tokens.size(0);
  MC_CHECK(tokens.ndim() == 2 && tokens.size(1) == 1 && tokens.dtype() == DType::I32 && rows == cache.rows &&
               positions.shape() == Shape({rows}) && positions.dtype() == DType::I32 &&
               positions.device() == tokens.device(),
           "decode_logits: tokens must be [", cache.rows, ", 1] i32 and positions [", cache.rows,
           "] i32 on one device, got ", tokens.describe(), " and ", positions.describe());
  std::vector<int64_t> host_start;  // MLA's cached attention takes each row's position on the host
  if (cfg_.mla.enabled)
    for (int32_t p : positions.to_vector<int32_t>()) host_start.push_back(p);
  Tensor h = Tensor::empty({rows, cfg_.hidden_size}, compute_, tokens.device());
  ops::embedding_forward(word_embeddings_->weight, tokens.view({rows}), h);
  if (position_embeddings_) {
    Tensor p = Tensor::empty(h.shape(), compute_, tokens.device());
    ops::embedding_forward(position_embeddings_->weight, positions, p);
    add_into(h, p);
  }
  for (int64_t i = 0; i < cfg_.num_layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    LayerCtx lc;
    const Tensor normed_in = attn_norm_[li].forward(h, lc.attn_norm);
    h = add_tensors(h, cfg_.mla.enabled
                           ? mla_[li].forward_cached(normed_in, 0, host_start, cache.k[li], cache.v[li])
                           : attention_[li].forward_decode(normed_in, positions, cache.k[li], cache.v[li]));
    const Tensor normed = mlp_norm_[li].forward(h, lc.mlp_norm);
    h = add_tensors(h, cfg_.is_moe(i) ? moe_[li].forward(normed, rows, false, 0, lc.moe) : mlp_[li].forward(normed, lc.mlp, rows));
  }
  Norm::Ctx norm_ctx;
  Linear::Ctx head_ctx;
  return head_.forward(final_norm_.forward(h, norm_ctx), head_ctx);
}

}  // namespace moecore
