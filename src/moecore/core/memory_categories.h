// What each byte of device memory is for: the categories of the memory report (`moecore train
// --memory-report`) and of the planner's prediction, listed once here so both use the same parts.
//
// Code that allocates opens a MemoryCategoryScope; the allocator (core/allocator.h) reads the
// innermost open scope of the allocating thread and charges the block to it until it is freed.
// Saved activations carry the module that saved them (the names of Megatron's recompute and
// offload modules where one exists). Allocations under no scope are "untagged". Allocator
// overhead (rounding, cached free blocks) is not a category: the ledger measures it directly.
//
// With the report off (the default) a scope costs one test of a global flag.
#pragma once

#include <cstdint>

namespace moecore {

enum class MemoryCategory : uint8_t {
  kUntagged,
  kWeights,         // parameters in their storage dtype, compute copies, fp32 masters
  kGradients,       // main gradients (the gradient buffers)
  kOptimizerState,  // AdamW moments (the distributed optimizer: this rank's shard)
  kActivations,     // tensors saved for the backward, by module (ActivationModule)
  kCommunication,   // pipeline send / receive buffers, dispatch buffers, collective staging
  kWorkspace,       // temporaries: activation gradients, optimizer and loss scratch
};
inline constexpr int kNumMemoryCategories = 7;

// Saved activations, by the module whose forward allocated them.
enum class ActivationModule : uint8_t {
  kBatch,          // the micro-batch's tokens, labels and positions
  kEmbedding,      // the embedding output
  kAttnNorm,       // attention's input norm
  kCoreAttn,       // q / k / v projections, RoPE, the attention output and its logsumexp
  kAttnProj,       // attention's output projection
  kResidual,       // the residual stream (h + attention, h + MLP)
  kMlpNorm,        // the MLP's / MoE's input norm
  kMlp,            // a dense MLP (fc1 output, activation)
  kRouter,         // router logits, probabilities, top-k
  kMoeDispatch,    // the permuted / dispatched token rows
  kExpertFc1,      // the experts' fc1 output
  kMoeAct,         // the experts' activation (SwiGLU / GELU output)
  kExpertFc2,      // the experts' fc2 output
  kMoeCombine,     // the combined MoE output
  kSharedExperts,  // the shared experts
  kFinalNorm,      // the final norm
  kOutputLayer,    // the output layer and loss (logits, lse, the fused head's input gradient)
  kMtp,            // multi-token prediction modules
  kOther,          // a forward's allocation outside the modules above
};
inline constexpr int kNumActivationModules = 19;

const char* memory_category_name(MemoryCategory c);   // "weights", "optimizer_state", ...
const char* activation_module_name(ActivationModule m);  // "core_attn", "moe_act", ...

// A block's tag: one of the non-activation categories, or kActivations with its module.
// Tags are small integers: [0, kNumMemoryCategories) for the categories (kActivations with
// ActivationModule::kOther), then one per other activation module.
using MemoryTag = uint8_t;
inline constexpr int kNumMemoryTags = kNumMemoryCategories + kNumActivationModules;
MemoryTag memory_tag(MemoryCategory c);
MemoryTag memory_tag(ActivationModule m);
MemoryCategory memory_tag_category(MemoryTag t);
const char* memory_tag_name(MemoryTag t);  // the category's or the module's name

// Whether the allocators record tags (set once, before the run allocates: --memory-report).
bool memory_accounting_enabled();
void enable_memory_accounting();
// The allocating thread's innermost tag (kUntagged outside every scope).
MemoryTag current_memory_tag();

// Charges this thread's allocations to a category (or an activation module) until it closes.
class MemoryCategoryScope {
 public:
  explicit MemoryCategoryScope(MemoryCategory c);
  explicit MemoryCategoryScope(ActivationModule m);
  ~MemoryCategoryScope();
  MemoryCategoryScope(const MemoryCategoryScope&) = delete;
  MemoryCategoryScope& operator=(const MemoryCategoryScope&) = delete;

 private:
  void push(MemoryTag t);
  bool pushed_ = false;
};

}  // namespace moecore
