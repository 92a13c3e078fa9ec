// Model configuration: a GPT-style decoder whose MLPs may be MoE layers, with Megatron-LM's
// names and semantics. Built from flags by `moecore train` (apps/train_command.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/ops/permute.h"
#include "moecore/ops/rope.h"
#include "moecore/ops/router.h"

namespace moecore {

enum class LoadBalancing { AuxLoss, SeqAuxLoss, GlobalAuxLoss, Sinkhorn, None };
const char* load_balancing_name(LoadBalancing lb);

struct MoeConfig {
  int64_t num_experts = 0;              // 0: every MLP is dense
  int64_t ffn_hidden_size = 0;          // --moe-ffn-hidden-size (expert FFN width)
  ops::RouterConfig router{.num_experts = 0, .topk = 2};  // top-k (Megatron default 2), score, groups, scaling
  bool router_fp64 = false;             // --moe-router-dtype fp64 (CPU only)
  double input_jitter_eps = 0.0;
  bool force_load_balancing = false;
  LoadBalancing load_balancing = LoadBalancing::AuxLoss;
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
  bool enable_expert_bias = false;
  double bias_update_rate = 1e-3;
  double capacity_factor = 0.0;         // <= 0: dropless
  ops::DropPolicy drop_policy = ops::DropPolicy::Probs;
  bool pad_to_capacity = false;
  int64_t shared_expert_size = 0;       // --moe-shared-expert-intermediate-size
  bool shared_expert_gate = false;      // sigmoid gate on the shared expert output (Qwen2-MoE)
  bool shared_expert_overlap = false;   // --moe-shared-expert-overlap (a schedule, not the model)
  bool per_layer_logging = false;
  bool recompute_act = false;           // --recompute-modules moe_act (a memory option, not the model)
};

// Multi-Latent Attention (--multi-latent-attention; DeepSeek-V2/V3, Megatron-Core's
// MLASelfAttention): low-rank query and key/value projections, per-head no-RoPE parts and one
// RoPE key shared by all heads (model/mla_attention.h).
struct MlaConfig {
  bool enabled = false;
  int64_t q_lora_rank = 0;           // 0: a plain query projection (DeepSeek-V2-Lite)
  int64_t kv_lora_rank = 32;         // Megatron's default
  int64_t qk_head_dim = 128;         // the no-RoPE part of a query/key head
  int64_t qk_pos_emb_head_dim = 64;  // the RoPE part
  int64_t v_head_dim = 128;
  bool recompute_up_proj = false;    // --recompute-modules mla_up_proj (a memory option, not the model)
  int64_t q_head_dim() const { return qk_head_dim + qk_pos_emb_head_dim; }  // D of the attention
};

// Activation recomputation of whole layers (memory options, not the model; model/gpt.h): the
// saved tensors dropped after the forward and rebuilt from a kept input before the backward.
struct RecomputeConfig {
  // --recompute-granularity full: "uniform" (the stage's layers in chunks of num_layers, each
  // chunk's input kept) or "block" (the stage's first num_layers layers, each from its input);
  // empty: none.
  std::string full_method;
  int64_t full_num_layers = 0;
  bool moe = false;  // --recompute-modules moe / --moe-layer-recompute: each MoE layer from its input
  bool mlp = false;  // --recompute-modules mlp: each dense MLP from its input
  // --recompute-modules core_attn: the attention output and logsumexp (the output projection's
  // input) rebuilt from the kept q, k, v (model/attention_block.h, model/core_attention.h)
  bool core_attn = false;
  // --recompute-modules shared_experts: the shared experts' saved tensors rebuilt from the MoE
  // layer's input at the start of its backward
  bool shared_experts = false;
  // --recompute-modules layernorm: the decoder layers' input norms' outputs are not kept (their
  // bytes released after the layer's forward, model/gpt.h) and recomputed before their backward
  bool layernorm = false;
};

// FP8 training (model/fp8_linear.h): the transformer layers' linears compute with FP8 operands.
struct Fp8Config {
  enum class Recipe { Tensorwise, Delayed, Blockwise };
  bool enabled = false;           // --fp8-format (or --fp8) given
  bool hybrid = false;            // --fp8-format hybrid: E4M3 forward, E5M2 gradients
  Recipe recipe = Recipe::Delayed;  // --fp8-recipe (Megatron's default: delayed)
  int64_t amax_history_len = 1;   // --fp8-amax-history-len (delayed)
  bool amax_compute_max = false;  // --fp8-amax-compute-algo max (else most_recent; delayed)
  int64_t margin = 0;             // --fp8-margin: delayed scales divided by 2^margin
  bool router_padding = false;    // --moe-router-padding-for-fp8 (ops/router_padding.h)
};

struct ModelConfig {
  int64_t num_layers = 2;
  int64_t hidden_size = 64;
  int64_t ffn_hidden_size = 0;          // 0: 4 * hidden (dense MLP width)
  int64_t num_attention_heads = 4;
  int64_t num_query_groups = 0;         // 0: = heads (no GQA)
  int64_t kv_channels = 0;              // head dim; 0: hidden / heads
  int64_t seq_length = 64;
  int64_t max_position_embeddings = 0;  // 0: seq_length
  int64_t vocab_size = 0;
  bool rmsnorm = true;                  // --normalization RMSNorm | LayerNorm
  double norm_epsilon = 1e-5;
  std::string position_embedding_type = "rope";  // rope | learned_absolute | none
  double rotary_base = 10000.0;
  bool rope_yarn = false;               // --rope-type yarn (else rope)
  ops::RopeScaling rope_scaling;        // YaRN's parameters (factor 0 unless --rope-type yarn)
  MlaConfig mla;
  bool swiglu = true;                   // else GELU
  bool add_bias_linear = true;          // --disable-bias-linear turns it off
  bool add_qkv_bias = false;            // --add-qkv-bias: biases on linear_q/k/v only (Qwen2), even
                                        // with --disable-bias-linear
  bool untie_embeddings = false;        // --untie-embeddings-and-output-weights
  double init_method_std = 0.02;
  bool qk_layernorm = false;
  // Multi-token prediction (model/mtp.h): --mtp-num-layers D sequential modules after the last
  // layer, their mean loss times --mtp-loss-scaling-factor added to the objective (training only).
  int64_t mtp_num_layers = 0;
  double mtp_loss_scaling_factor = 0.1;
  MoeConfig moe;
  RecomputeConfig recompute;
  Fp8Config fp8;
  std::vector<bool> moe_layer;          // per layer: MoE (true) or dense MLP
  // --fine-grained-activation-offloading --offload-modules (model/activation_offload.h): a memory
  // option, not the model; empty: none.
  std::vector<std::string> offload_modules;

  int64_t head_dim() const { return kv_channels; }
  int64_t kv_heads() const { return num_query_groups; }
  bool is_moe(int64_t layer) const { return moe.num_experts > 0 && moe_layer[static_cast<size_t>(layer)]; }
  // The stage with the output layer holds the word embedding too: tied to the output layer, or
  // read by the MTP modules (with pipeline stages a copy, its gradient summed with the first's).
  bool head_stage_has_embedding() const { return !untie_embeddings || mtp_num_layers > 0; }
};

// Fills derived defaults and checks every combination, raising one Error per problem that names
// the flag(s), what was wrong and what is expected.
void finalize_model_config(ModelConfig& cfg, const std::string& moe_layer_freq);

// The MLA and YaRN flags' values (called by finalize_model_config); each Error names the flag.
void validate_mla_config(const ModelConfig& cfg);

// The MoE flags: fills derived values (the expert FFN width, the router's expert count, sinkhorn
// selection) and checks every combination of them -- the one place they are checked; the router
// ops check only what their kernels need. Each Error names the flag(s) (called by
// finalize_model_config; `dense_ffn_hidden_size` is the default expert width).
void validate_moe_config(MoeConfig& moe, int64_t dense_ffn_hidden_size);
// The router's part of that: top-k, groups, scaling, pre-softmax ("router config: --flag ...").
void validate_router_flags(const ops::RouterConfig& router);

// Parses --moe-layer-freq: an int N (every N-th layer is MoE, starting with layer 0) or a
// list "[0,1,1,1]" with one entry per layer.
std::vector<bool> parse_moe_layer_freq(const std::string& text, int64_t num_layers);

}  // namespace moecore
