// Parameter counts of a model described by its ModelConfig, without allocating any weights: the
// real GPTModel is built on a shapes-only ParamStore (ParamStore::set_shapes_only), one rank, the
// whole model, so the count is the model's own registration and cannot drift from it.
//
// total:  every trainable parameter once (a tied output layer shares the embedding: counted once;
//         the router's expert-bias buffer is not a parameter and is left out).
// active: the parameters one token passes through, Megatron's definition: embeddings, attention
//         (with QK-layernorm), every norm, the router, the shared experts, dense MLPs, the output
//         layer, and of each MoE layer's routed experts top-k of the E (expert weights x k / E).
// Both include the MTP modules (--mtp-num-layers; their own part "mtp", active mtp_active);
// DeepSeek-V3's published 671B / 37B leave them out: subtract part("mtp") and mtp_active.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moecore/model/config.h"

namespace moecore {

struct ParamCount {
  int64_t total = 0;
  int64_t active = 0;
  int64_t mtp_active = 0;  // the MTP modules' share of active
  // (part, total elements), in a fixed order: embedding, attention, norms, router,
  // routed_experts, shared_experts, dense_mlp, output_layer, mtp (zero parts included).
  std::vector<std::pair<std::string, int64_t>> parts;
  int64_t part(const std::string& name) const;
};

// cfg: a finalized ModelConfig (finalize_model_config, as the train command leaves it).
ParamCount count_parameters(const ModelConfig& cfg);

// "46.70B total, 12.88B active per token" and one line per part.
std::string describe_param_count(const ParamCount& c);

}  // namespace moecore
