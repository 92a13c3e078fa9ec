// The GPT-style decoder: embedding (+ learned positions), layers of
//   h = h + attention(norm(h));  h = h + mlp_or_moe(norm(h))
// a final norm, the output head (tied to the embedding unless untied) and the cross-entropy
// loss; in training, with --mtp-num-layers, the multi-token prediction modules (model/mtp.h) after
// the last layer, sharing the embedding and the output head. Parameter names follow Megatron-Core (embedding.word_embeddings.weight,
// decoder.layers.N.self_attention.linear_q.weight, decoder.layers.N.mlp.experts...,
// decoder.final_layernorm.weight, output_layer.weight).
#pragma once

#include <functional>
#include <vector>

#include "moecore/model/activation_offload.h"
#include "moecore/core/memory_categories.h"
#include "moecore/model/attention_block.h"
#include "moecore/model/layers.h"
#include "moecore/model/mla_attention.h"
#include "moecore/model/mtp.h"
#include "moecore/moe/moe_layer.h"

namespace moecore {

// A pipeline stage's share of the model: decoder layers [first_layer, end_layer) (global
// numbers, so parameter names do not depend on the layout), the embedding on the first stage,
// the final norm, output layer and loss on the last. The default is the whole model. With tied
// embeddings a last stage without the embedding still holds embedding.word_embeddings.weight
// (the output layer's weight): a copy kept equal to the first stage's by the trainer.
struct PipelineStage {
  int64_t first_layer = 0, end_layer = -1;  // -1: every layer
  bool has_embedding = true, has_head = true;
};

// MOECORE_FUSED_HEAD unset or not "0".
bool fused_head_enabled();

// Checks a micro-batch on the host before it goes to the device (tokens and labels [B, S] i32,
// contiguous, on the CPU): every token in [0, vocab_size), every label < vocab_size (negative:
// ignored). Returns the number of labelled tokens, for GPTModel::Ctx::checked_num_labels.
int64_t check_batch_on_host(const Tensor& tokens, const Tensor& labels, int64_t vocab_size);

class GPTModel {
 public:
  // par: the expert-parallel and balancing groups of the MoE layers (default: one rank);
  // dense: tensor, sequence and context parallelism (model/tensor_parallel.h): with TP the
  // embedding and output layer are split over the vocabulary (Megatron's VocabParallelEmbedding
  // and vocab-parallel cross-entropy), attention over heads, MLPs over the FFN features.
  GPTModel(const ModelConfig& cfg, ParamStore& store, const MoeParallel& par = {}, const PipelineStage& stage = {},
           const DenseParallel& dense = {});

  struct LayerCtx {
    Norm::Ctx attn_norm, mlp_norm;
    AttentionBlock::Ctx attn;
    MlaAttention::Ctx mla;  // --multi-latent-attention
    Mlp::Ctx mlp;
    MoeLayer::Ctx moe;
    // Recomputation (cfg.recompute). Full: the layers of a chunk [recompute_first, this layer]
    // dropped their saved tensors (the MoE router's excepted, see MoeLayer::drop_for_recompute);
    // the chunk's first layer keeps its input in recompute_input. -1: not dropped.
    int64_t recompute_first = -1;
    Tensor recompute_input;
    // --recompute-modules mlp: the dense MLP's input (its Ctx dropped); moe: the MoE layer's
    // saved tensors after the routing dropped (its Ctx keeps the input).
    Tensor mlp_input;
    bool moe_dropped = false;
    // --recompute-modules layernorm: the two input norms' outputs, whose bytes (shared with what
    // attention and the MLP / MoE layer saved of them) are released after the forward and
    // recomputed into the same tensors before the backward reads them (undefined: kept).
    Tensor attn_normed, mlp_normed;
  };
  struct Ctx {
    Tensor token_ids, position_ids, labels;  // [T] i32 (position ids: this rank's tokens after SP)
    int64_t batch = 0, num_labels = 0;
    int64_t label_seq = 0;  // labels per sample, to name a bad label's (sample, position); 0 under CP
    // >= 0: the caller checked this micro-batch's tokens and labels against the vocabulary on the
    // host and counted its labelled tokens (check_batch_on_host; under CP over the whole
    // sequences, before the split). The forward then reads neither back from the device (no
    // wait). -1: the forward checks and counts them itself (one read each). Setting it also
    // turns off the embedding's device-side id check (ops::EmbeddingIdsValidated), so set it only
    // from check_batch_on_host on these very tokens and labels.
    int64_t checked_num_labels = -1;
    std::vector<LayerCtx> layers;
    Norm::Ctx final_norm;
    Linear::Ctx head;
    Tensor logits, lse;  // [T, V] (V / TP under TP), [T] (the whole vocabulary's)
    Tensor hidden_out;   // a stage without the head: its output [T, H] for the next stage
    // Fused output layer (training): set fused_head_scale to the grad_scale that backward() will
    // get, before forward(); the forward then runs the output layer, the loss and their backward
    // chunk by chunk (no [T, V] logits kept) and keeps only the gradient of the final norm's
    // output (d_head_input). 0: the plain path. Evaluation (training = false) computes the
    // loss chunk by chunk as well. MOECORE_FUSED_HEAD=0 turns both off.
    double fused_head_scale = 0;
    Tensor d_head_input;
    // Multi-token prediction (training on the stage with the head, cfg.mtp_num_layers > 0).
    // mtp_inputs: the shifted tokens and labels of each depth on the model's device (CP: this
    // rank's chunks of make_mtp_batch on the whole sequences; counts over the whole sequences);
    // empty: the forward builds them from tokens and labels (one read; not under CP).
    MtpBatch mtp_inputs;
    // Set by the forward: each depth's summed token losses ([1] on the device, as the main
    // loss's; CP: over the whole sequences) and its labelled tokens.
    std::vector<Tensor> mtp_loss_sums;
    std::vector<int64_t> mtp_num_labels;
    // Each depth's module, and its output layer and loss in a Ctx of their own (only the head's
    // fields used: labels, counts, logits or the fused head's gradient).
    std::vector<MtpLayer::Ctx> mtp_layers;
    std::vector<Ctx> mtp_heads;
    // --offload-modules: this micro-batch's decoder-layer tensors on the host (model/activation_offload.h).
    std::shared_ptr<ActivationStash> offload_stash;
  };

  // tokens and labels [B, S] i32 on the model's device (labels < 0 are ignored). Returns the mean
  // loss over labelled tokens. Keeps what backward needs in ctx.
  // Context parallelism: tokens and labels are this rank's chunks [B, S / CP]
  // (context_parallel_slice); the loss is still the mean over the whole sequences (the sums and
  // label counts are added over the CP group).
  // Pipeline stages: without the embedding the input is hidden_in [B*S, H] (the previous stage's
  // output; tokens still give the batch shape); without the head the output is ctx.hidden_out
  // and the return value 0.
  double forward(const Tensor& tokens, const Tensor& labels, bool training, uint64_t rng_seed, Ctx& ctx,
                 const Tensor& hidden_in = Tensor());
  // The same forward without reading the loss back: the sum of the labelled tokens' losses over
  // the whole sequences (CP: summed over the group on the device) as a one-element tensor on the
  // model's device (f32, f64 for f64 models), ctx.num_labels their count. A stage without the
  // head returns an undefined tensor and sets ctx.num_labels = 0.
  Tensor forward_loss_sum(const Tensor& tokens, const Tensor& labels, bool training, uint64_t rng_seed, Ctx& ctx,
                          const Tensor& hidden_in = Tensor());
  // grad_scale = d(objective) / d(this micro-batch's mean loss), e.g. 1 / num_microbatches.
  // layer_done(i), when given, is called once decoder layer i's parameter gradients are final
  // (its whole backward is issued): the trainer starts their reduction while the backward goes on.
  // Pipeline stages: without the head, d_hidden_out is the gradient of ctx.hidden_out (from the
  // next stage); without the embedding the gradient of hidden_in is returned (else undefined).
  Tensor backward(double grad_scale, Ctx& ctx, const std::function<void(int64_t)>& layer_done = {},
                  const Tensor& d_hidden_out = Tensor());
  // --overlap-moe-expert-parallel-comm (train/ep_overlap_schedule.h): a training pass in pieces,
  // so that one micro-batch's forward and another's backward interleave layer by layer. The same
  // operations in the same order as forward_loss_sum and backward (model/gpt_phased.cpp), for the
  // whole model on one pipeline stage without full-layer, MoE-layer or norm recomputation,
  // offloading or MTP (refused there; recomputation inside a module runs as without the phases):
  //   forward:  phased_forward_begin; for each layer i, for each phase p < kLayerPhases:
  //             forward_layer_phase(i, p); the loss sum = phased_forward_end
  //   backward: phased_backward_begin; for each layer i from the last, for each phase p:
  //             backward_layer_phase(i, p); phased_backward_end
  // Phases 1 and 3 of an MoE layer are its expert-parallel collectives only (forward: the
  // dispatch's and the combine's all-to-all; backward: the combine's, then the dispatch's), the
  // other phases compute; a dense layer computes in phase 0 and does nothing in the others.
  // With pass.delay_wgrad (--delay-wgrad-compute) an MoE layer's backward phase 2 leaves the
  // experts' weight gradients to backward_layer_wgrad, which the caller runs after phase 3.
  static constexpr int kLayerPhases = 5;
  static bool phase_communicates(int phase) { return phase == 1 || phase == 3; }
  struct PhasedPass {
    Tensor h;  // the residual stream, or its gradient in the backward
    MoeLayer::Flight moe;
    bool training = true, delay_wgrad = false;
    uint64_t rng_seed = 0;
    double grad_scale = 0;  // the backward's (as backward() takes it)
    std::function<void(int64_t)> layer_done;  // as backward() takes it
  };
  void phased_forward_begin(const Tensor& tokens, const Tensor& labels, PhasedPass& pass, Ctx& ctx);
  void forward_layer_phase(int64_t i, int phase, PhasedPass& pass, Ctx& ctx);
  Tensor phased_forward_end(const Tensor& tokens, const Tensor& labels, PhasedPass& pass, Ctx& ctx);
  void phased_backward_begin(PhasedPass& pass, Ctx& ctx);
  void backward_layer_phase(int64_t i, int phase, PhasedPass& pass, Ctx& ctx);
  void backward_layer_wgrad(int64_t i, Ctx& ctx);
  void phased_backward_end(PhasedPass& pass, Ctx& ctx);
  int64_t first_layer() const { return stage_.first_layer; }
  int64_t end_layer() const { return stage_.end_layer; }

  // Logits [B*S, V] in the compute dtype, no loss (generation; one rank).
  Tensor logits(const Tensor& tokens);
  // Generation with a KV cache (one rank, the whole model): each decoder layer's K and V after
  // RoPE, [rows, max_len, Hkv, D] in the compute dtype, allocated once (MLA: every head's K
  // [rows, max_len, heads, qk + RoPE dim] and V [rows, max_len, heads, v dim]).
  struct KvCache {
    std::vector<Tensor> k, v;  // per decoder layer
    int64_t rows = 0, max_len = 0;
  };
  KvCache make_kv_cache(int64_t rows, int64_t max_len, Device device) const;
  // tokens [R, S] i32 on the model's device: S new tokens of each of R sequences, sequence r in
  // cache row first_row + r at positions start[r] .. start[r] + S - 1 (R == 1 or S == 1: a
  // prompt's prefill or one decode step of every row). Their K/V enter the cache; returns the
  // logits of each sequence's last new token [R, V] in the compute dtype. The MoE layers run
  // in evaluation mode on the new tokens only.
  Tensor cached_logits(const Tensor& tokens, int64_t first_row, const std::vector<int64_t>& start, KvCache& cache);
  // One decoding step of every cache row from device inputs: tokens [R, 1] i32, positions [R] i32
  // (each row's new token and its position), R = cache.rows. Returns the logits [R, V] in the
  // compute dtype. On a GPU nothing is read back to the host where the ops allow it (the MoE
  // layers with device-side expert offsets): train/decode_step.h captures it in a CUDA graph.
  // cached_logits with S == 1 and first_row 0 is this call. With --multi-latent-attention the
  // positions are read back to the host (MlaAttention::forward_cached takes host positions), so
  // that step cannot be captured: decode_graphable() is false.
  Tensor decode_logits(const Tensor& tokens, const Tensor& positions, KvCache& cache);
  bool decode_graphable() const { return !cfg_.mla.enabled; }
  // --overlap-param-gather: wait(-1) runs before the embedding reads its weights, wait(i) before
  // decoder layer i's forward, wait(num_layers) before the final norm and the output layer (the
  // optimizer's gathers of those weights may still be running on the communication stream).
  void set_param_wait(std::function<void(int64_t)> wait) { param_wait_ = std::move(wait); }
  // Rows per chunk of the fused output layer (tests; 0: kFusedHeadChunkElements / vocabulary rows).
  void set_head_chunk_rows(int64_t rows) { head_chunk_rows_ = rows; }
  // Logits per chunk: 256 MiB in bf16 (4096 rows at a 32k vocabulary). Each chunk's wgrad reads
  // and writes the whole fp32 output-layer gradient, so fewer, larger chunks are faster: 1024
  // rows -> 4096 took 17% (mixtral-small) and 20% (finegrained-small) off the output layer's time
  // with the peak memory unchanged (measured: docs/performance-log.md, "Step timers, ...").
  static constexpr int64_t kFusedHeadChunkElements = int64_t{1} << 27;
  // Rows of the hidden states passed between pipeline stages for these (CP-local) tokens.
  int64_t hidden_rows(const Tensor& tokens) const { return dense_.local_tokens(tokens.numel()); }

  // The MoE layers of this stage, the MTP modules' after the decoder's.
  std::vector<MoeLayer*> moe_layers();
  // Decoder layer index of each moe_layers() entry (MTP module k: num_layers + k - 1, as
  // Megatron counts them for the MoE logging and DeepSeek-V3 numbers them).
  std::vector<int64_t> moe_layer_numbers() const;
  const ModelConfig& config() const { return cfg_; }
  const PipelineStage& stage() const { return stage_; }
  DType compute_dtype() const { return compute_; }

 private:
  Tensor embed(const Tensor& tokens, Ctx& ctx);
  // Decoder layer i's attention block (AttentionBlock, or MlaAttention with --multi-latent-attention).
  Tensor attention_forward(size_t i, const Tensor& x, int64_t batch, LayerCtx& lc) const;
  Tensor attention_backward(size_t i, const Tensor& dy, int64_t batch, LayerCtx& lc) const;
  // The transformer layers of this stage (without the final norm).
  Tensor decoder_forward(Tensor h, bool training, uint64_t rng_seed, Ctx& ctx);
  // forward_loss_sum's first part (checks, the embedding or the stage's input) and its last (the
  // final norm, the output layer and loss, MTP; or the stage's output).
  Tensor forward_input(const Tensor& tokens, const Tensor& labels, Ctx& ctx, const Tensor& hidden_in);
  Tensor forward_output(Tensor h, const Tensor& tokens, const Tensor& labels, bool training, uint64_t rng_seed,
                        Ctx& ctx);
  // backward's first part (the head and MTP, or the next stage's gradient: returns the residual
  // stream's gradient) and its last (the embedding's backward, or the stage's input gradient;
  // resets ctx).
  Tensor backward_output(double grad_scale, Ctx& ctx, const Tensor& d_hidden_out);
  Tensor backward_input(const Tensor& dh, Ctx& ctx);
  // Decoder layer li's attention half (norm, attention, residual) forward, and its backward into dh.
  Tensor layer_attention_forward(size_t li, Tensor h, bool training, int64_t batch, LayerCtx& lc, bool recomputing);
  void layer_attention_backward(size_t li, Tensor& dh, Ctx& ctx);
  // Decoder layer i from its input h. recomputing: rebuild what the first forward saved (the
  // MoE layer reuses its routing; no selective recomputation drops anything again).
  Tensor layer_forward(int64_t i, Tensor h, bool training, uint64_t rng_seed, int64_t batch, LayerCtx& lc,
                       bool recomputing);
  // --recompute-granularity full: the first layer of layer i's recomputed chunk, -1 if none.
  int64_t full_recompute_first(int64_t i) const;
  // Reruns the forward of layers [first, last] from ctx.layers[first].recompute_input.
  void recompute_layers(int64_t first, int64_t last, Ctx& ctx);
  // Before layer i's backward: rebuilds what recomputation dropped (whole chunk or module).
  void recompute_before_backward(int64_t i, Ctx& ctx);
  // --offload-modules (model/gpt_offload.cpp): layer i's saved tensors of the chosen modules, in
  // a fixed order; offload_layer after its forward, reload_layer before its backward.
  std::vector<OffloadSlot> offload_slots(int64_t i, LayerCtx& lc);
  void offload_layer(int64_t i, Ctx& ctx, Device device);
  void reload_layer(int64_t i, Ctx& ctx);
  // --recompute-modules layernorm (LayerCtx::attn_normed, mlp_normed).
  bool releases_norm_outputs(bool training, bool recomputing, const LayerCtx& lc) const;
  static void release_norm_output(const Tensor& normed, Tensor& kept);
  static void recompute_norm_output(const Norm& norm, const Norm::Ctx& norm_ctx, Tensor& kept, ActivationModule module);
  // Output layer and loss: returns the sum of the labelled tokens' losses of this rank's
  // (CP-local) tokens on the device; ctx.num_labels is the whole sequences' label count.
  Tensor head_forward(const Tensor& h, Ctx& ctx);
  // The output layer and the loss chunk by chunk (no [T, V] logits kept); with grad_scale > 0
  // also their backward (the output layer's weight gradient accumulates; ctx.d_head_input keeps
  // the gradient of the final norm's output), with 0 the loss only (evaluation).
  Tensor head_forward_chunked(const Tensor& h, double grad_scale, Ctx& ctx);
  Tensor head_backward(double grad_scale, Ctx& ctx);
  // The output layer's and loss's backward up to the gradient of their input (the final norm's
  // output); head_backward adds the final norm's backward.
  Tensor head_input_grad(double grad_scale, Ctx& ctx);
  // The word embedding of ids [T] (this rank's CP-local tokens) -> [T_local, H] (after the TP
  // exit region: summed, or this rank's SP slice), and its backward into the weight's gradient.
  Tensor embed_words(const Tensor& ids, int64_t batch) const;
  void embed_words_backward(const Tensor& ids, const Tensor& dx, int64_t batch) const;
  // Multi-token prediction: from h0, the decoder's output before the final norm, every depth's
  // loss into ctx.mtp_loss_sums; the backward returns the gradient of h0.
  void mtp_forward(const Tensor& h0, const Tensor& tokens, const Tensor& labels, uint64_t rng_seed, Ctx& ctx);
  Tensor mtp_backward(double grad_scale, Ctx& ctx);
  // Per-token loss and logsumexp of logits rows (vocabulary-parallel under TP), and its backward
  // in place (dloss_value: d(objective)/d(each labelled token's loss)).
  void loss_rows(const Tensor& logits, const Tensor& labels, Tensor& loss, Tensor& lse) const;
  void loss_rows_backward(Tensor& logits, const Tensor& labels, const Tensor& lse, double dloss_value) const;
  // Sets ctx.num_labels to the whole sequences' labelled tokens: ctx.checked_num_labels, or
  // ctx.labels read to the host, checked and counted (summed over CP).
  void count_labels(Ctx& ctx) const;

  ModelConfig cfg_;
  PipelineStage stage_;
  DenseParallel dense_;
  int64_t vocab_start_ = 0;  // this rank's first vocabulary row (TP)
  int64_t head_chunk_rows_ = 0;
  Param* word_embeddings_ = nullptr;
  Param* position_embeddings_ = nullptr;
  std::vector<Norm> attn_norm_, mlp_norm_;
  std::vector<AttentionBlock> attention_;
  std::vector<MlaAttention> mla_;  // --multi-latent-attention: the layers' attention instead
  std::vector<Mlp> mlp_;
  std::vector<MoeLayer> moe_;
  Norm final_norm_;
  Linear head_;
  std::vector<MtpLayer> mtp_;  // on the stage with the head
  DType compute_;
  std::function<void(int64_t)> param_wait_;
  OffloadModules offload_;                          // --offload-modules
  std::shared_ptr<ActivationOffloader> offloader_;  // created by the first offload
  void wait_params(int64_t unit) const {
    if (param_wait_) param_wait_(unit);
  }
};

}  // namespace moecore
