// The category and module names, the process-wide switch and the per-thread scope stack.
#include "moecore/core/memory_categories.h"

#include <atomic>

#include "moecore/core/error.h"

namespace moecore {

namespace {
std::atomic<bool> g_enabled{false};
constexpr int kMaxDepth = 32;
thread_local MemoryTag t_stack[kMaxDepth];
thread_local int t_depth = 0;
}  // namespace

const char* memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::kUntagged: return "untagged";
    case MemoryCategory::kWeights: return "weights";
    case MemoryCategory::kGradients: return "gradients";
    case MemoryCategory::kOptimizerState: return "optimizer_state";
    case MemoryCategory::kActivations: return "activations";
    case MemoryCategory::kCommunication: return "communication";
    case MemoryCategory::kWorkspace: return "workspace";
  }
  return "?";
}

const char* activation_module_name(ActivationModule m) {
  switch (m) {
    case ActivationModule::kBatch: return "batch";
    case ActivationModule::kEmbedding: return "embedding";
    case ActivationModule::kAttnNorm: return "attn_norm";
    case ActivationModule::kCoreAttn: return "core_attn";
    case ActivationModule::kAttnProj: return "attn_proj";
    case ActivationModule::kResidual: return "residual";
    case ActivationModule::kMlpNorm: return "mlp_norm";
    case ActivationModule::kMlp: return "mlp";
    case ActivationModule::kRouter: return "router";
    case ActivationModule::kMoeDispatch: return "moe_dispatch";
    case ActivationModule::kExpertFc1: return "expert_fc1";
    case ActivationModule::kMoeAct: return "moe_act";
    case ActivationModule::kExpertFc2: return "expert_fc2";
    case ActivationModule::kMoeCombine: return "moe_combine";
    case ActivationModule::kSharedExperts: return "shared_experts";
    case ActivationModule::kFinalNorm: return "final_norm";
    case ActivationModule::kOutputLayer: return "output_layer";
    case ActivationModule::kMtp: return "mtp";
    case ActivationModule::kOther: return "other";
  }
  return "?";
}

MemoryTag memory_tag(MemoryCategory c) { return static_cast<MemoryTag>(c); }

MemoryTag memory_tag(ActivationModule m) {
  if (m == ActivationModule::kOther) return memory_tag(MemoryCategory::kActivations);
  return static_cast<MemoryTag>(kNumMemoryCategories + static_cast<int>(m));
}

MemoryCategory memory_tag_category(MemoryTag t) {
  return t < kNumMemoryCategories ? static_cast<MemoryCategory>(t) : MemoryCategory::kActivations;
}

const char* memory_tag_name(MemoryTag t) {
  if (t == memory_tag(MemoryCategory::kActivations)) return activation_module_name(ActivationModule::kOther);
  if (t < kNumMemoryCategories) return memory_category_name(static_cast<MemoryCategory>(t));
  return activation_module_name(static_cast<ActivationModule>(t - kNumMemoryCategories));
}

bool memory_accounting_enabled() { return g_enabled.load(std::memory_order_relaxed); }
void enable_memory_accounting() { g_enabled.store(true, std::memory_order_relaxed); }

MemoryTag current_memory_tag() {
  return t_depth > 0 ? t_stack[t_depth - 1] : memory_tag(MemoryCategory::kUntagged);
}

MemoryCategoryScope::MemoryCategoryScope(MemoryCategory c) {
  if (memory_accounting_enabled()) push(memory_tag(c));
}

MemoryCategoryScope::MemoryCategoryScope(ActivationModule m) {
  if (memory_accounting_enabled()) push(memory_tag(m));
}

void MemoryCategoryScope::push(MemoryTag t) {
  MC_CHECK(t_depth < kMaxDepth, "memory categories: more than ", kMaxDepth, " nested MemoryCategoryScopes");
  t_stack[t_depth++] = t;
  pushed_ = true;
}

MemoryCategoryScope::~MemoryCategoryScope() {
  if (pushed_) --t_depth;
}

}  // namespace moecore
