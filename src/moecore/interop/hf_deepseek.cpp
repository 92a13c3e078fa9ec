#include "moecore/interop/hf_deepseek.h"

#include <cmath>
#include <cstdio>

#include "moecore/core/error.h"
#include "moecore/interop/hf_config_values.h"

using nlohmann::json;

namespace moecore::interop {

namespace {

// An integer that may be null or absent (then `fallback`).
int64_t int_or(const json& cfg, const char* key, int64_t fallback, const std::string& origin) {
  if (!cfg.contains(key) || cfg[key].is_null()) return fallback;
  MC_CHECK(cfg[key].is_number_integer(), origin, ": config.json '", key, "' is ", cfg[key].dump(), "; expected an integer");
  return cfg[key].get<int64_t>();
}
double num_or(const json& cfg, const char* key, double fallback) {
  return cfg.contains(key) && cfg[key].is_number() ? cfg[key].get<double>() : fallback;
}
bool bool_or(const json& cfg, const char* key, bool fallback) {
  return cfg.contains(key) && cfg[key].is_boolean() ? cfg[key].get<bool>() : fallback;
}
std::string str_or(const json& cfg, const char* key, const std::string& fallback) {
  return cfg.contains(key) && cfg[key].is_string() ? cfg[key].get<std::string>() : fallback;
}

// RoPE: rope_theta, and YaRN's flags from rope_scaling / rope_parameters (transformers 5).
void rope_flags(const json& cfg, const std::string& origin, std::vector<std::pair<std::string, std::string>>& out) {
  double theta = num_or(cfg, "rope_theta", 10000.0);
  bool yarn = false;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!cfg.contains(key) || cfg[key].is_null()) continue;
    const json& r = cfg[key];
    MC_CHECK(r.is_object(), origin, ": config.json '", key, "' is not an object");
    theta = num_or(r, "rope_theta", theta);
    const std::string type = str_or(r, "rope_type", str_or(r, "type", "default"));
    MC_CHECK(type == "default" || type == "yarn", origin, ": ", key, " type '", type,
             "' is not supported (default RoPE or yarn)");
    if (type != "yarn" || yarn) continue;
    yarn = true;
    MC_CHECK(r.contains("factor") && r["factor"].is_number(), origin, ": ", key, " (yarn) has no number 'factor'");
    out.push_back({"rope-type", "yarn"});
    out.push_back({"rotary-scaling-factor", config_number_text(r["factor"].get<double>())});
    out.push_back({"original-max-position-embeddings",
                   config_number_text(num_or(r, "original_max_position_embeddings", 4096))});
    out.push_back({"beta-fast", config_number_text(num_or(r, "beta_fast", 32))});
    out.push_back({"beta-slow", config_number_text(num_or(r, "beta_slow", 1))});
    out.push_back({"mscale", config_number_text(num_or(r, "mscale", 1))});
    out.push_back({"mscale-all-dim", config_number_text(num_or(r, "mscale_all_dim", 0))});
  }
  out.push_back({"rotary-base", config_number_text(theta)});
}

// The routing flags (see the header).
void routing_flags(const json& cfg, bool v3, int64_t experts, int64_t topk, const std::string& origin,
                   std::vector<std::pair<std::string, std::string>>& out) {
  const std::string arch = v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM";
  const std::string scoring = str_or(cfg, "scoring_func", v3 ? "sigmoid" : "softmax");
  const std::string method = str_or(cfg, "topk_method", v3 ? "noaux_tc" : "greedy");
  const bool norm = bool_or(cfg, "norm_topk_prob", v3);
  const int64_t n_group = int_or(cfg, "n_group", 1, origin), topk_group = int_or(cfg, "topk_group", 1, origin);
  const double scaling = num_or(cfg, "routed_scaling_factor", 1.0);
  MC_CHECK(std::isfinite(scaling) && scaling > 0, origin, ": routed_scaling_factor ", scaling, " must be positive");
  bool groups = n_group > 1;
  if (v3) {
    MC_CHECK(scoring == "sigmoid", origin, ": ", arch, " scoring_func '", scoring, "' is not supported (sigmoid)");
    MC_CHECK(method == "noaux_tc", origin, ": ", arch, " topk_method '", method, "' is not supported (noaux_tc)");
    MC_CHECK(norm || topk == 1, origin, ": ", arch, " norm_topk_prob false with num_experts_per_tok ", topk,
             " is not supported (moecore's sigmoid router renormalises the chosen experts)");
    MC_CHECK(!groups || topk == 2 * topk_group, origin, ": ", arch, " ranks expert groups by their best 2 scores; ",
             "moecore by their best num_experts_per_tok / topk_group = ", topk, " / ", topk_group,
             ": they agree only when num_experts_per_tok = 2 * topk_group");
  } else {
    MC_CHECK(scoring == "softmax", origin, ": ", arch, " scoring_func '", scoring, "' is not supported (softmax)");
    MC_CHECK(method == "greedy" || method == "group_limited_greedy", origin, ": ", arch, " topk_method '", method,
             "' is not supported (greedy or group_limited_greedy)");
    MC_CHECK(!norm, origin, ": ", arch, " norm_topk_prob true is not supported (transformers' DeepseekV2 never ",
             "renormalises the top-k probabilities; moecore maps norm_topk_prob false)");
    groups = method == "group_limited_greedy" && n_group > 1;
    MC_CHECK(!groups || topk == topk_group, origin, ": ", arch, " group_limited_greedy ranks expert groups by their ",
             "best expert; moecore by their best num_experts_per_tok / topk_group = ", topk, " / ", topk_group,
             ": they agree only when num_experts_per_tok = topk_group");
  }
  if (groups)
    MC_CHECK(experts % n_group == 0 && topk_group >= 1 && topk_group <= n_group, origin, ": n_group ", n_group,
             " / topk_group ", topk_group, " do not split n_routed_experts ", experts);
  out.push_back({"moe-router-score-function", v3 ? "sigmoid" : "softmax"});
  out.push_back({"moe-router-pre-softmax", v3 ? "false" : "true"});
  out.push_back({"moe-router-enable-expert-bias", v3 ? "true" : "false"});
  out.push_back({"moe-router-num-groups", std::to_string(groups ? n_group : 0)});
  out.push_back({"moe-router-group-topk", std::to_string(groups ? topk_group : 0)});
  out.push_back({"moe-router-topk-scaling-factor", config_number_text(scaling == 1.0 ? 0.0 : scaling)});
  // DeepSeek's balancing loss: the sequence-wise one (seq_aux true) or the batch one, weight aux_loss_alpha.
  out.push_back({"moe-router-load-balancing-type", bool_or(cfg, "seq_aux", true) ? "seq_aux_loss" : "aux_loss"});
  out.push_back({"moe-aux-loss-coeff", config_number_text(num_or(cfg, "aux_loss_alpha", 0.0))});
}

}  // namespace

bool deepseek_rope_interleaved(const json& cfg) { return bool_or(cfg, "rope_interleave", true); }

std::vector<std::pair<std::string, std::string>> deepseek_config_to_train_flags(const json& cfg, bool v3,
                                                                                const std::string& origin) {
  const std::string arch = v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM";
  MC_CHECK(!cfg.contains("quantization_config") || cfg["quantization_config"].is_null(), origin,
           ": quantized checkpoints (quantization_config ", cfg.value("quantization_config", json()).dump(),
           ") are not supported; convert a BF16 copy (DeepSeek's fp8_cast_bf16.py)");
  const std::string act = str_or(cfg, "hidden_act", "silu");
  MC_CHECK(act == "silu", origin, ": hidden_act '", act, "' is not supported (SwiGLU needs silu)");
  MC_CHECK(!bool_or(cfg, "attention_bias", false), origin, ": attention_bias true is not supported");
  MC_CHECK(!bool_or(cfg, "mlp_bias", false), origin, ": mlp_bias true is not supported");
  MC_CHECK(v3 || deepseek_rope_interleaved(cfg), origin, ": ", arch, " rope_interleave false is not supported");
  const int64_t layers = need_int(cfg, "num_hidden_layers", origin), hidden = need_int(cfg, "hidden_size", origin);
  const int64_t heads = need_int(cfg, "num_attention_heads", origin), maxpos = need_int(cfg, "max_position_embeddings", origin);
  MC_CHECK(cfg.contains("n_routed_experts") && cfg["n_routed_experts"].is_number_integer(), origin,
           ": config.json has no integer 'n_routed_experts' (a dense DeepSeek model has no MoE equivalent here)");
  const int64_t experts = cfg["n_routed_experts"].get<int64_t>(), topk = need_int(cfg, "num_experts_per_tok", origin);
  const int64_t moe_ffn = need_int(cfg, "moe_intermediate_size", origin);
  const int64_t shared = int_or(cfg, "n_shared_experts", 0, origin) * moe_ffn;
  const int64_t first_dense = int_or(cfg, "first_k_dense_replace", 0, origin);
  MC_CHECK(first_dense >= 0 && first_dense < layers, origin, ": first_k_dense_replace ", first_dense,
           " must be in [0, num_hidden_layers ", layers, ")");
  MC_CHECK(int_or(cfg, "moe_layer_freq", 1, origin) == 1, origin, ": moe_layer_freq ", cfg["moe_layer_freq"].dump(),
           " is not supported (1: every layer from first_k_dense_replace on is MoE)");
  std::string freq = "[";
  for (int64_t i = 0; i < layers; ++i) freq += std::string(i ? "," : "") + (i >= first_dense ? "1" : "0");
  freq += "]";
  if (first_dense == 0) freq = "1";
  const int64_t mtp = v3 ? int_or(cfg, "num_nextn_predict_layers", 0, origin) : 0;
  MC_CHECK(mtp >= 0, origin, ": num_nextn_predict_layers ", mtp, " must be >= 0");
  const bool tied = bool_or(cfg, "tie_word_embeddings", false);

  std::vector<std::pair<std::string, std::string>> out = {
      {"num-layers", std::to_string(layers)},
      {"hidden-size", std::to_string(hidden)},
      {"ffn-hidden-size", std::to_string(need_int(cfg, "intermediate_size", origin))},
      {"num-attention-heads", std::to_string(heads)},
      {"vocab-size", std::to_string(need_int(cfg, "vocab_size", origin))},
      {"normalization", "RMSNorm"},
      {"norm-epsilon", config_number_text(num_or(cfg, "rms_norm_eps", 1e-6))},
      {"position-embedding-type", "rope"},
      {"max-position-embeddings", std::to_string(maxpos)},
      {"seq-length", std::to_string(std::min<int64_t>(maxpos, 4096))},
      {"swiglu", "true"},
      {"disable-bias-linear", "true"},
      {"untie-embeddings-and-output-weights", tied ? "false" : "true"},
      {"multi-latent-attention", "true"},
      {"q-lora-rank", std::to_string(int_or(cfg, "q_lora_rank", 0, origin))},
      {"kv-lora-rank", std::to_string(need_int(cfg, "kv_lora_rank", origin))},
      {"qk-head-dim", std::to_string(need_int(cfg, "qk_nope_head_dim", origin))},
      {"qk-pos-emb-head-dim", std::to_string(need_int(cfg, "qk_rope_head_dim", origin))},
      {"v-head-dim", std::to_string(need_int(cfg, "v_head_dim", origin))},
      {"qk-layernorm", "true"},  // MLA's two latent norms (q_a_layernorm, kv_a_layernorm)
      {"num-experts", std::to_string(experts)},
      {"moe-layer-freq", freq},
      {"moe-router-topk", std::to_string(topk)},
      {"moe-ffn-hidden-size", std::to_string(moe_ffn)},
      {"moe-shared-expert-intermediate-size", std::to_string(shared)},
      {"mtp-num-layers", std::to_string(mtp)},
      {"mock-data", "true"},
      {"micro-batch-size", "1"},
      {"global-batch-size", "1"},
      {"train-iters", "1"},
  };
  rope_flags(cfg, origin, out);
  routing_flags(cfg, v3, experts, topk, origin, out);
  return out;
}

json deepseek_config_from_args(const ModelConfig& c, bool v3, const std::string& origin) {
  const std::string arch = v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM";
  const ops::RouterConfig& r = c.moe.router;
  MC_CHECK(c.mla.enabled && c.qk_layernorm, origin, ": ", arch, " needs --multi-latent-attention with --qk-layernorm");
  MC_CHECK(c.moe.shared_expert_size % c.moe.ffn_hidden_size == 0 && !c.moe.shared_expert_gate, origin, ": ", arch,
           "'s shared experts are n_shared_experts ungated experts of --moe-ffn-hidden-size: ",
           "--moe-shared-expert-intermediate-size must be a multiple of it, without --moe-shared-expert-gate");
  int64_t first_dense = 0;
  while (first_dense < c.num_layers && !c.is_moe(first_dense)) ++first_dense;
  for (int64_t i = first_dense; i < c.num_layers; ++i)
    MC_CHECK(c.is_moe(i), origin, ": ", arch, " has dense layers only before the first MoE layer (--moe-layer-freq)");
  if (v3)
    MC_CHECK(r.score == ops::RouterScore::Sigmoid && c.moe.enable_expert_bias &&
                 (r.num_groups == 0 || r.topk == 2 * r.group_topk),
             origin, ": ", arch, " routes with --moe-router-score-function sigmoid and ",
             "--moe-router-enable-expert-bias, groups (if any) with --moe-router-topk = 2 * --moe-router-group-topk");
  else
    MC_CHECK(r.score == ops::RouterScore::Softmax && r.pre_softmax && !c.moe.enable_expert_bias &&
                 (r.num_groups == 0 || r.topk == r.group_topk),
             origin, ": ", arch, " routes with --moe-router-pre-softmax (softmax), no expert bias, groups (if any) with ",
             "--moe-router-topk = --moe-router-group-topk");
  MC_CHECK(v3 || c.mtp_num_layers == 0, origin, ": ", arch, " has no multi-token prediction (--mtp-num-layers)");
  json j = {{"architectures", {arch}},
            {"model_type", v3 ? "deepseek_v3" : "deepseek_v2"},
            {"hidden_act", "silu"},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.ffn_hidden_size},
            {"moe_intermediate_size", c.moe.ffn_hidden_size},
            {"num_hidden_layers", c.num_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_attention_heads},
            {"n_shared_experts", c.moe.shared_expert_size / c.moe.ffn_hidden_size},
            {"n_routed_experts", c.moe.num_experts},
            {"num_experts_per_tok", r.topk},
            {"routed_scaling_factor", r.scaling_factor == 0 ? 1.0 : r.scaling_factor},
            {"kv_lora_rank", c.mla.kv_lora_rank},
            {"q_lora_rank", c.mla.q_lora_rank > 0 ? json(c.mla.q_lora_rank) : json(nullptr)},
            {"qk_rope_head_dim", c.mla.qk_pos_emb_head_dim},
            {"qk_nope_head_dim", c.mla.qk_head_dim},
            {"v_head_dim", c.mla.v_head_dim},
            {"topk_method", v3 ? "noaux_tc" : (r.num_groups > 0 ? "group_limited_greedy" : "greedy")},
            {"scoring_func", v3 ? "sigmoid" : "softmax"},
            {"n_group", r.num_groups > 0 ? r.num_groups : 1},
            {"topk_group", r.num_groups > 0 ? r.group_topk : 1},
            {"first_k_dense_replace", first_dense},
            {"moe_layer_freq", 1},
            {"norm_topk_prob", v3},
            {"aux_loss_alpha", c.moe.aux_loss_coeff},
            {"seq_aux", c.moe.load_balancing == LoadBalancing::SeqAuxLoss},
            {"max_position_embeddings", c.max_position_embeddings},
            {"rms_norm_eps", c.norm_epsilon},
            {"rope_theta", c.rotary_base},
            {"rope_scaling", nullptr},
            {"tie_word_embeddings", !c.untie_embeddings},
            {"attention_bias", false},
            {"torch_dtype", "float32"}};
  if (v3) j["num_nextn_predict_layers"] = c.mtp_num_layers;
  if (c.rope_yarn) {
    const ops::RopeScaling& s = c.rope_scaling;
    j["rope_scaling"] = {{"type", "yarn"},
                         {"factor", s.factor},
                         {"original_max_position_embeddings", static_cast<int64_t>(s.original_max_position)},
                         {"beta_fast", s.beta_fast},
                         {"beta_slow", s.beta_slow},
                         {"mscale", s.mscale},
                         {"mscale_all_dim", s.mscale_all_dim}};
  }
  return j;
}

}  // namespace moecore::interop
