#include "moecore/train/arguments.h"

#include <algorithm>
#include <cstdio>

#include "moecore/core/error.h"

namespace moecore {

const std::vector<std::string>& checkpoint_model_flags() {
  static const std::vector<std::string> names = {
      "num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "group-query-attention",
      "num-query-groups", "kv-channels", "seq-length", "max-position-embeddings", "vocab-size", "normalization",
      "norm-epsilon", "position-embedding-type", "no-position-embedding", "rotary-base", "swiglu",
      "disable-bias-linear", "add-qkv-bias", "untie-embeddings-and-output-weights", "qk-layernorm", "num-experts",
      "moe-layer-freq", "moe-ffn-hidden-size", "moe-router-topk", "moe-router-score-function",
      "moe-router-pre-softmax", "moe-router-num-groups", "moe-router-group-topk", "moe-router-topk-scaling-factor",
      "moe-router-load-balancing-type", "moe-aux-loss-coeff", "moe-z-loss-coeff", "moe-router-enable-expert-bias",
      "moe-router-bias-update-rate", "moe-expert-capacity-factor", "moe-token-drop-policy",
      "moe-pad-expert-input-to-capacity", "moe-input-jitter-eps", "moe-shared-expert-intermediate-size",
      "moe-shared-expert-gate", "tokenizer-type", "tokenizer-model", "make-vocab-size-divisible-by",
      "multi-latent-attention", "q-lora-rank", "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim",
      "rope-type", "rotary-scaling-factor", "original-max-position-embeddings", "beta-fast", "beta-slow", "mscale",
      "mscale-all-dim", "mtp-num-layers"};
  return names;
}

void check_resume_flags(const std::vector<std::pair<std::string, std::string>>& saved, const TrainArgs& now,
                        bool check_schedule) {
  static const std::vector<std::string> model = {
      "num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "group-query-attention",
      "num-query-groups", "kv-channels", "max-position-embeddings", "vocab-size", "normalization",
      "position-embedding-type", "rotary-base", "swiglu", "disable-bias-linear", "add-qkv-bias",
      "untie-embeddings-and-output-weights", "qk-layernorm", "num-experts", "moe-layer-freq", "moe-ffn-hidden-size",
      "moe-router-topk", "moe-router-score-function", "moe-router-pre-softmax", "moe-router-num-groups",
      "moe-router-group-topk", "moe-router-topk-scaling-factor", "moe-router-enable-expert-bias",
      "moe-shared-expert-intermediate-size", "moe-shared-expert-gate", "tokenizer-type",
      "multi-latent-attention", "q-lora-rank", "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim",
      "rope-type", "rotary-scaling-factor", "original-max-position-embeddings", "beta-fast", "beta-slow", "mscale",
      "mscale-all-dim", "mtp-num-layers"};
  static const std::vector<std::string> schedule = {"lr", "min-lr", "lr-decay-style", "lr-decay-iters",
                                                    "lr-warmup-iters", "lr-wsd-decay-iters", "lr-wsd-decay-style"};
  static const std::vector<std::string> per_run = {"config", "load", "save", "save-interval", "metrics-file",
                                                   "tensorboard-dir", "train-iters", "log-interval", "eval-interval",
                                                   "eval-iters", "device", "override-opt-param-scheduler",
                                                   "timing-log-level", "memory-report", "finetune", "no-load-optim", "no-load-rng",
                                                   "tokenizer-model"};
  auto in = [](const std::vector<std::string>& list, const std::string& n) {
    return std::find(list.begin(), list.end(), n) != list.end();
  };
  // --no-position-embedding changes the model only with learned_absolute: compare what it makes.
  auto saved_value = [&](const std::string& name, const std::string& otherwise) {
    const auto it = std::find_if(saved.begin(), saved.end(), [&](const auto& kv) { return kv.first == name; });
    return it == saved.end() ? otherwise : it->second;
  };
  std::string saved_positions = saved_value("position-embedding-type", now.model.position_embedding_type);
  if (saved_positions == "learned_absolute" && saved_value("no-position-embedding", "false") == "true")
    saved_positions = "none";
  MC_CHECK(saved_positions == now.model.position_embedding_type, "--load: the checkpoint's model has position "
           "embedding '", saved_positions, "' (--position-embedding-type, --no-position-embedding); this run's has '",
           now.model.position_embedding_type, "' (the model must be the same to resume)");
  for (const auto& [name, value] : now.flag_values) {
    const auto it = std::find_if(saved.begin(), saved.end(), [&](const auto& kv) { return kv.first == name; });
    if (it == saved.end() || it->second == value || in(per_run, name)) continue;
    if (name == "no-position-embedding" || name == "position-embedding-type") continue;  // compared above
    // A checkpoint without a tokenizer (moecore convert of a folder without one) takes this run's;
    // the tokenizer file itself is compared by content when the flags are read (apps/train_command).
    if (name == "tokenizer-type" && it->second.empty()) continue;
    MC_CHECK(!in(model, name), "--load: the checkpoint was trained with --", name, " ", it->second, "; this run has ",
             value, " (the model must be the same to resume)");
    if (!check_schedule && !in(model, name)) continue;
    MC_CHECK(!in(schedule, name) || now.override_opt_param_scheduler, "--load: the checkpoint's --", name, " is ",
             it->second, ", this run's is ", value,
             "; keep the learning-rate settings when resuming, or pass --override-opt-param-scheduler");
    std::printf("note: --%s changed from %s to %s since the checkpoint\n", name.c_str(), it->second.c_str(),
                value.c_str());
  }
}

parallel::ParallelConfig TrainArgs::parallel_config() const {
  parallel::ParallelConfig c;
  c.world = world;
  c.tp = tp;
  c.cp = cp;
  c.pp = pp;
  c.ep = ep;
  c.etp = etp;
  return c;
}

}  // namespace moecore
