// DeepSeek-V2 / DeepSeek-V3 config.json <-> moecore train flags (the tensor mapping is in
// hf_convert.cpp). Used by the converter only.
//
// config.json -> flags: MLA sizes (q_lora_rank null = a plain q_proj), YaRN (rope_scaling or
// rope_parameters of type yarn), n_routed_experts / moe_intermediate_size / n_shared_experts,
// first_k_dense_replace dense layers (the others MoE; moe_layer_freq must be 1), routing, the
// sequence-wise aux loss (aux_loss_alpha, seq_aux) and, for V3, num_nextn_predict_layers (MTP).
// Routing, as transformers computes it:
//   DeepseekV3ForCausalLM: sigmoid scores, e_score_correction_bias for the selection (our
//     --moe-router-enable-expert-bias), groups ranked by the sum of their best 2 biased scores
//     (ours: of their best topk/group_topk, so num_experts_per_tok / topk_group must be 2 with
//     n_group > 1), the chosen k renormalised (norm_topk_prob true, as Megatron's sigmoid router
//     always does for k > 1), times routed_scaling_factor. Experts of dropped groups are excluded
//     (DeepSeek's inference code: -inf); transformers fills 0.0 instead, which differs only where
//     a kept expert's biased score is negative.
//   DeepseekV2ForCausalLM: softmax over all experts, top-k (greedy) or group-limited (groups
//     ranked by their best expert: num_experts_per_tok must equal topk_group), no
//     renormalisation (norm_topk_prob false), times routed_scaling_factor = our pre-softmax.
// Every other value of scoring_func, topk_method, norm_topk_prob or moe_layer_freq, attention or
// MLP biases, and quantized checkpoints (quantization_config) are refused by name.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "moecore/model/config.h"

namespace moecore::interop {

std::vector<std::pair<std::string, std::string>> deepseek_config_to_train_flags(const nlohmann::json& cfg, bool v3,
                                                                                const std::string& origin);
// The config.json of a moecore model (no recorded HF config: a model trained in moecore). Errors
// name the flags that the architecture cannot express.
nlohmann::json deepseek_config_from_args(const ModelConfig& c, bool v3, const std::string& origin);
// Whether the checkpoint's q/k RoPE rows are interleaved pairs (DeepSeek's layout; V3's
// rope_interleave false: already halves).
bool deepseek_rope_interleaved(const nlohmann::json& cfg);

}  // namespace moecore::interop
