// Fine-grained activation offloading (Megatron's --fine-grained-activation-offloading
// --offload-modules): the tensors a named module's backward reads (its saved input) leave the
// device after the layer's forward and come back before the layer's backward.
//
//   attn_norm   the attention norm's input (the layer input) and its statistics
//   core_attn   q, k, v (after RoPE), the attention output and its logsumexp
//   attn_proj   the output projection's input (the attention output)
//   mlp_norm    the MLP / MoE norm's input and its statistics
//   expert_fc1  the experts' fc1 input (the dispatched rows)
//   moe_act     the experts' activation input (fc1's output) and the rows' probabilities
//
// Forward: after each decoder layer the chosen tensors are copied to pinned host memory on a side
// stream (the copy waits for the compute stream through an event) and dropped from the layer's
// Ctx; the device memory is handed back once the compute stream has waited for the copy, at the
// next layer's offload (the end of the next layer's forward) or the end of the micro-batch's
// forward at the latest. Tensors that share bytes (a view of another) travel once.
// Backward: before a layer's backward its tensors are back (copied on the side stream; the compute
// stream waits for that copy's event), and the next layer in backward order is prefetched: the
// next lower offloaded layer of the same micro-batch, after its lowest the highest of the oldest
// other micro-batch with offloaded layers (the pipeline schedules run the backwards of one model
// chunk in the order of their forwards). Nothing makes the host wait: host buffers are freed
// once their copy has run, polled with cudaEventQuery.
//
// The stash of a micro-batch (ActivationStash) lives in its GPTModel::Ctx, so micro-batches of a
// pipeline schedule never mix. On the CPU the same code runs with a separate host buffer and
// synchronous copies (the values are the same bits, which the tests check).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/core/memory_categories.h"
#include "moecore/core/tensor.h"

namespace moecore {

enum class OffloadModule : uint8_t { kAttnNorm, kCoreAttn, kAttnProj, kMlpNorm, kExpertFc1, kMoeAct };
inline constexpr int kNumOffloadModules = 6;

const char* offload_module_name(OffloadModule m);  // "attn_norm", ...
std::string offload_module_names();                // "attn_norm, core_attn, ..." (messages)
std::optional<OffloadModule> parse_offload_module(std::string_view name);

// The modules chosen by --offload-modules.
struct OffloadModules {
  std::array<bool, kNumOffloadModules> on{};
  bool any() const;
  bool has(OffloadModule m) const { return on[static_cast<size_t>(m)]; }
};
// Names from --offload-modules (checked: an unknown one raises, listing the valid ones).
OffloadModules parse_offload_modules(const std::vector<std::string>& names);

// One saved tensor of a layer's Ctx that may be offloaded; made_by: the memory report's module of
// its bytes (the module that allocated them), which its reloaded copy is charged to again.
struct OffloadSlot {
  Tensor* tensor;
  OffloadModule module;
  ActivationModule made_by;
};

// Host memory holding offloaded activations (all ranks of this process): now, its maximum, and
// each module's share at that maximum.
struct OffloadHostUsage {
  int64_t now = 0, peak = 0;
  std::array<int64_t, kNumOffloadModules> at_peak{};
};
OffloadHostUsage offload_host_usage();

class ActivationStash;  // a micro-batch's offloaded layers (activation_offload.cpp)

class ActivationOffloader {
 public:
  explicit ActivationOffloader(Device device);
  ~ActivationOffloader();
  ActivationOffloader(const ActivationOffloader&) = delete;
  ActivationOffloader& operator=(const ActivationOffloader&) = delete;

  // After decoder layer `layer`'s forward: its defined, contiguous slot tensors go to the host and
  // the slots are cleared. `stash` is created on the micro-batch's first call.
  void offload(std::shared_ptr<ActivationStash>& stash, int64_t layer, const std::vector<OffloadSlot>& slots);
  // The end of a micro-batch's forward: the last layer's device tensors are handed back.
  void finish_forward();
  // The start of a micro-batch's backward: its highest offloaded layer starts coming back.
  void begin_backward(const std::shared_ptr<ActivationStash>& stash);
  // Before layer `layer`'s backward: the slots (the list offload got) hold their tensors again,
  // ready on the compute stream; the next layer in backward order starts coming back.
  void reload(const std::shared_ptr<ActivationStash>& stash, int64_t layer, const std::vector<OffloadSlot>& slots);

 private:
  struct InFlight;
  Stream side_stream();
  void release_forward_copies();
  void poll_host_buffers(bool wait);
  void prefetch_highest(ActivationStash& stash);

  Device device_;
  Stream side_;
  bool side_created_ = false;
  std::deque<std::weak_ptr<ActivationStash>> order_;  // micro-batches with offloaded layers, forward order
  std::vector<Tensor> releasing_;                      // the last offloaded layer's device tensors
  std::shared_ptr<Event> releasing_copied_;            // their copies to the host
  std::deque<std::unique_ptr<InFlight>> host_in_flight_;  // host buffers whose reload may still run
};

// The end of a forward (any return path): ActivationOffloader::finish_forward.
class OffloadForwardEnd {
 public:
  // offloader: may be created during the forward (its first offload).
  explicit OffloadForwardEnd(const std::shared_ptr<ActivationOffloader>& offloader) : offloader_(offloader) {}
  ~OffloadForwardEnd();
  OffloadForwardEnd(const OffloadForwardEnd&) = delete;
  OffloadForwardEnd& operator=(const OffloadForwardEnd&) = delete;

 private:
  const std::shared_ptr<ActivationOffloader>& offloader_;
};

}  // namespace moecore
