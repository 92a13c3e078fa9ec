#include "moecore/model/config.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "moecore/core/error.h"

namespace moecore {

const char* load_balancing_name(LoadBalancing lb) {
  switch (lb) {
    case LoadBalancing::AuxLoss: return "aux_loss";
    case LoadBalancing::SeqAuxLoss: return "seq_aux_loss";
    case LoadBalancing::GlobalAuxLoss: return "global_aux_loss";
    case LoadBalancing::Sinkhorn: return "sinkhorn";
    case LoadBalancing::None: return "none";
  }
  return "?";
}

std::vector<bool> parse_moe_layer_freq(const std::string& text, int64_t num_layers) {
  std::vector<bool> out;
  if (!text.empty() && text.front() == '[') {
    MC_CHECK(text.back() == ']', "--moe-layer-freq '", text, "': expected an int or a list like [0,1,1,1]");
    std::stringstream ss(text.substr(1, text.size() - 2));
    std::string item;
    while (std::getline(ss, item, ',')) {
      while (!item.empty() && item.front() == ' ') item.erase(item.begin());
      while (!item.empty() && item.back() == ' ') item.pop_back();
      MC_CHECK(item == "0" || item == "1", "--moe-layer-freq '", text, "': entries must be 0 or 1, got '", item, "'");
      out.push_back(item == "1");
    }
    MC_CHECK(static_cast<int64_t>(out.size()) == num_layers, "--moe-layer-freq '", text, "' has ", out.size(),
             " entries; expected one per layer (--num-layers ", num_layers, ")");
    return out;
  }
  int64_t freq = 0;
  try {
    size_t used = 0;
    freq = std::stoll(text, &used);
    MC_CHECK(used == text.size(), "");
  } catch (...) {
    MC_FAIL("--moe-layer-freq '", text, "': expected an int or a list like [0,1,1,1]");
  }
  MC_CHECK(freq >= 1, "--moe-layer-freq ", freq, " must be >= 1");
  for (int64_t i = 0; i < num_layers; ++i) out.push_back(i % freq == 0);
  return out;
}

void finalize_model_config(ModelConfig& c, const std::string& moe_layer_freq) {
  MC_CHECK(c.num_layers >= 1, "--num-layers ", c.num_layers, " must be >= 1");
  MC_CHECK(c.hidden_size >= 1, "--hidden-size ", c.hidden_size, " must be >= 1");
  MC_CHECK(c.num_attention_heads >= 1, "--num-attention-heads ", c.num_attention_heads, " must be >= 1");
  MC_CHECK(c.vocab_size >= 2, "--vocab-size ", c.vocab_size, " must be >= 2 (give --vocab-size with --mock-data)");
  MC_CHECK(c.seq_length >= 1, "--seq-length ", c.seq_length, " must be >= 1");
  if (c.kv_channels == 0) {
    MC_CHECK(c.hidden_size % c.num_attention_heads == 0, "--hidden-size ", c.hidden_size,
             " is not divisible by --num-attention-heads ", c.num_attention_heads, " (or give --kv-channels)");
    c.kv_channels = c.hidden_size / c.num_attention_heads;
  }
  if (c.num_query_groups == 0) c.num_query_groups = c.num_attention_heads;
  MC_CHECK(c.num_query_groups >= 1 && c.num_attention_heads % c.num_query_groups == 0, "--num-attention-heads ",
           c.num_attention_heads, " is not divisible by --num-query-groups ", c.num_query_groups);
  MC_CHECK(c.ffn_hidden_size >= 0 && c.kv_channels >= 0 && c.num_query_groups >= 0 && c.max_position_embeddings >= 0,
           "--ffn-hidden-size, --kv-channels, --num-query-groups and --max-position-embeddings must be >= 0");
  MC_CHECK(c.rotary_base > 0, "--rotary-base ", c.rotary_base, " must be > 0");
  if (c.ffn_hidden_size == 0) {
    // Megatron: 4h, or with SwiGLU 2/3 of that rounded down to a multiple of 64 (same parameters)
    c.ffn_hidden_size = c.swiglu ? std::max<int64_t>(64, (8 * c.hidden_size / 3) / 64 * 64) : 4 * c.hidden_size;
  }
  if (c.max_position_embeddings == 0) c.max_position_embeddings = c.seq_length;
  MC_CHECK(c.seq_length <= c.max_position_embeddings, "--seq-length ", c.seq_length,
           " exceeds --max-position-embeddings ", c.max_position_embeddings);
  MC_CHECK(c.position_embedding_type == "rope" || c.position_embedding_type == "learned_absolute" ||
               c.position_embedding_type == "none",
           "--position-embedding-type '", c.position_embedding_type, "': expected rope, learned_absolute or none");
  if (c.position_embedding_type == "rope" && !c.mla.enabled)
    MC_CHECK(c.kv_channels % 2 == 0, "rope needs an even head dim; got --kv-channels ", c.kv_channels);
  MC_CHECK(c.norm_epsilon > 0, "--norm-epsilon ", c.norm_epsilon, " must be > 0");
  validate_mla_config(c);
  MC_CHECK(c.init_method_std > 0, "--init-method-std ", c.init_method_std, " must be > 0");
  MC_CHECK(c.mtp_num_layers >= 0, "--mtp-num-layers ", c.mtp_num_layers, " must be >= 0 (0: no multi-token prediction)");
  MC_CHECK(std::isfinite(c.mtp_loss_scaling_factor) && c.mtp_loss_scaling_factor >= 0, "--mtp-loss-scaling-factor ",
           c.mtp_loss_scaling_factor, " must be a finite number >= 0 (Megatron's default 0.1)");
  MC_CHECK(c.mtp_num_layers == 0 || c.position_embedding_type != "learned_absolute", "--mtp-num-layers ",
           c.mtp_num_layers, " with --position-embedding-type learned_absolute is not available: the MTP modules "
           "take the token embeddings only; use rope or none");

  MoeConfig& m = c.moe;
  MC_CHECK(m.num_experts >= 0, "--num-experts ", m.num_experts, " must be >= 0");
  if (m.num_experts == 0) {
    c.moe_layer.assign(static_cast<size_t>(c.num_layers), false);
    MC_CHECK(m.shared_expert_size == 0, "--moe-shared-expert-intermediate-size needs --num-experts");
    return;
  }
  c.moe_layer = parse_moe_layer_freq(moe_layer_freq.empty() ? "1" : moe_layer_freq, c.num_layers);
  validate_moe_config(m, c.ffn_hidden_size);
}

void validate_mla_config(const ModelConfig& c) {
  const ops::RopeScaling& y = c.rope_scaling;
  if (c.rope_yarn) {
    MC_CHECK(c.mla.enabled, "--rope-type yarn needs --multi-latent-attention (YaRN is MLA's RoPE, as in Megatron-Core)");
    MC_CHECK(std::isfinite(y.factor) && y.factor > 0, "--rope-type yarn needs --rotary-scaling-factor > 0, got ",
             y.factor);
    MC_CHECK(std::isfinite(y.original_max_position) && y.original_max_position >= 1,
             "--original-max-position-embeddings ", y.original_max_position, " must be >= 1");
    MC_CHECK(std::isfinite(y.beta_fast) && y.beta_fast > 0 && std::isfinite(y.beta_slow) && y.beta_slow > 0,
             "--beta-fast ", y.beta_fast, " and --beta-slow ", y.beta_slow, " must be > 0");
    MC_CHECK(std::isfinite(y.mscale) && std::isfinite(y.mscale_all_dim) && ops::yarn_mscale(y.factor, y.mscale_all_dim) > 0,
             "--mscale ", y.mscale, " / --mscale-all-dim ", y.mscale_all_dim, " must be finite, with 0.1 x "
             "--mscale-all-dim x ln(--rotary-scaling-factor) + 1 > 0");
  } else {
    MC_CHECK(!y.yarn(), "--rotary-scaling-factor needs --rope-type yarn");
  }
  if (!c.mla.enabled) return;
  const MlaConfig& m = c.mla;
  MC_CHECK(m.q_lora_rank >= 0, "--q-lora-rank ", m.q_lora_rank, " must be >= 0 (0: a plain query projection)");
  MC_CHECK(m.kv_lora_rank >= 1, "--kv-lora-rank ", m.kv_lora_rank, " must be >= 1");
  MC_CHECK(m.qk_head_dim >= 1, "--qk-head-dim ", m.qk_head_dim, " must be >= 1");
  MC_CHECK(m.qk_pos_emb_head_dim >= 2 && m.qk_pos_emb_head_dim % 2 == 0, "--qk-pos-emb-head-dim ",
           m.qk_pos_emb_head_dim, " must be even and >= 2 (RoPE rotates pairs)");
  MC_CHECK(m.v_head_dim >= 1, "--v-head-dim ", m.v_head_dim, " must be >= 1");
  MC_CHECK(c.position_embedding_type == "rope", "--multi-latent-attention needs --position-embedding-type rope, got ",
           c.position_embedding_type);
  MC_CHECK(c.num_query_groups == c.num_attention_heads, "--multi-latent-attention has one key/value per head: "
           "--group-query-attention / --num-query-groups do not apply");
  MC_CHECK(!c.add_qkv_bias, "--add-qkv-bias does not apply to --multi-latent-attention (use --add-bias-linear "
           "semantics: every projection has a bias unless --disable-bias-linear)");
}

void validate_router_flags(const ops::RouterConfig& c) {
  constexpr const char* w = "router config: ";
  MC_CHECK(c.num_experts > 0, w, "--num-experts must be positive, got ", c.num_experts);
  MC_CHECK(c.topk >= 1 && c.topk <= c.num_experts, w, "--moe-router-topk ", c.topk, " must be in [1, --num-experts ",
           c.num_experts, "]");
  MC_CHECK(c.num_groups >= 0, w, "--moe-router-num-groups must be >= 0 (0 = off), got ", c.num_groups);
  if (c.num_groups == 0) {
    MC_CHECK(c.group_topk == 0, w, "--moe-router-group-topk ", c.group_topk, " needs --moe-router-num-groups");
  } else {
    MC_CHECK(c.num_experts % c.num_groups == 0, w, "--moe-router-num-groups ", c.num_groups,
             " must divide --num-experts ", c.num_experts);
    MC_CHECK(c.group_topk >= 1 && c.group_topk <= c.num_groups, w, "--moe-router-group-topk ", c.group_topk,
             " must be in [1, --moe-router-num-groups ", c.num_groups, "]");
    MC_CHECK(c.topk % c.group_topk == 0, w, "--moe-router-topk ", c.topk, " must be divisible by --moe-router-group-topk ",
             c.group_topk);
    MC_CHECK(c.topk / c.group_topk <= c.num_experts / c.num_groups, w, "--moe-router-topk ", c.topk,
             " needs more than the ", c.num_experts / c.num_groups, " experts of a group per kept group (--moe-router-group-topk ",
             c.group_topk, ")");
  }
  MC_CHECK(std::isfinite(c.scaling_factor) && c.scaling_factor >= 0, w,
           "--moe-router-topk-scaling-factor must be positive (0 = unset), got ", c.scaling_factor);
  MC_CHECK(!(c.pre_softmax && c.score == ops::RouterScore::Sigmoid), w,
           "--moe-router-pre-softmax applies only to --moe-router-score-function softmax");
}

void validate_moe_config(MoeConfig& m, int64_t dense_ffn_hidden_size) {
  MC_CHECK(m.ffn_hidden_size >= 0, "--moe-ffn-hidden-size ", m.ffn_hidden_size, " must be >= 0");
  MC_CHECK(m.capacity_factor >= 0, "--moe-expert-capacity-factor ", m.capacity_factor, " must be >= 0 (0: dropless)");
  MC_CHECK(m.shared_expert_size >= 0, "--moe-shared-expert-intermediate-size ", m.shared_expert_size, " must be >= 0");
  if (m.ffn_hidden_size == 0) m.ffn_hidden_size = dense_ffn_hidden_size;
  m.router.num_experts = m.num_experts;
  validate_router_flags(m.router);
  MC_CHECK(m.aux_loss_coeff >= 0, "--moe-aux-loss-coeff ", m.aux_loss_coeff, " must be >= 0");
  MC_CHECK(m.z_loss_coeff >= 0, "--moe-z-loss-coeff ", m.z_loss_coeff, " must be >= 0");
  MC_CHECK(m.input_jitter_eps >= 0 && m.input_jitter_eps < 1, "--moe-input-jitter-eps ", m.input_jitter_eps,
           " must be in [0, 1)");
  MC_CHECK(m.bias_update_rate >= 0, "--moe-router-bias-update-rate ", m.bias_update_rate, " must be >= 0");
  MC_CHECK(!m.enable_expert_bias || m.router.score == ops::RouterScore::Sigmoid || m.router.pre_softmax,
           "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or --moe-router-pre-softmax "
           "(the bias shifts scores, not logits)");
  if (m.load_balancing == LoadBalancing::Sinkhorn) {
    MC_CHECK(m.router.score == ops::RouterScore::Softmax && !m.router.pre_softmax && m.router.num_groups == 0,
             "--moe-router-load-balancing-type sinkhorn selects with its own scores: it cannot be combined with "
             "--moe-router-score-function sigmoid, --moe-router-pre-softmax or --moe-router-num-groups");
    MC_CHECK(!m.enable_expert_bias, "--moe-router-enable-expert-bias cannot be combined with sinkhorn balancing");
    // Megatron's sinkhorn routing ignores the scaling factor; we refuse it rather than ignore it silently.
    MC_CHECK(m.router.scaling_factor == 0, "router config: --moe-router-load-balancing-type sinkhorn does not support "
             "--moe-router-topk-scaling-factor");
    m.router.sinkhorn = true;
  }
  if (m.capacity_factor > 0) {
    MC_CHECK(m.load_balancing != LoadBalancing::Sinkhorn,
             "--moe-expert-capacity-factor works with --moe-router-load-balancing-type aux_loss, seq_aux_loss, "
             "global_aux_loss or none; not with sinkhorn");
  } else {
    MC_CHECK(!m.pad_to_capacity, "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor");
  }
  if (m.shared_expert_gate)
    MC_CHECK(m.shared_expert_size > 0, "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size");
}

}  // namespace moecore
