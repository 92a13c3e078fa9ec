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
// Forward: after each part of a decoder layer (its attention block, then its MLP / MoE block:
// one offload group each) the chosen tensors are copied to pinned host memory on a device-to-host
// stream (the copy waits for the compute stream through an event) and dropped from the layer's
// Ctx. The forward does not wait for the copy: the device tensors are kept by the offloader
// until the copy's event has fired (polled with cudaEventQuery) and only then handed back to the
// allocator. At most offload_window() groups' device tensors are kept so: beyond it the oldest
// group's are handed back after the compute stream waits for its copy (a stream-ordered free: the
// allocator's blocks are reused only after it), which bounds the memory in flight.
// The model's last decoder layer is not offloaded (its backward comes first; GPTModel).
// Backward: offload_backward_groups() groups in backward order (the one in its backward counted)
// are brought back ahead of their backward on a host-to-device stream (after their copy to the
// host), and the compute stream waits for a group's event only when its layer's backward starts. The order: this micro-batch's next lower
// group, after its lowest the highest of the oldest other micro-batch with offloaded groups (the
// pipeline schedules run the backwards of one model chunk in the order of their forwards). A
// group whose device tensors are still kept (its copy to the host still running) is taken back
// as it is, without a copy. Nothing makes the host wait: host buffers (from the pinned
// allocator's cache: no new pinned allocation after the first step) are freed once their copies
// have run, polled with cudaEventQuery.
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

// MOECORE_OFFLOAD_WINDOW (default 2): how many offload groups (a layer's attention part, its MLP
// part) may be in flight -- device tensors kept while their copy to the host runs in the forward,
// groups brought back ahead of their backward. Another value than an integer >= 1 raises, naming
// the switch.
int64_t offload_window();
inline constexpr int64_t kDefaultOffloadWindow = 2;
// The groups on the device in the backward: the one in its backward and those brought back ahead,
// max(2, window) (at least one ahead, so that a reload's copy overlaps the backward before it).
int64_t offload_backward_groups(int64_t window);

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
struct LayerGroup;      // one offload group of a micro-batch (activation_offload.cpp)

class ActivationOffloader {
 public:
  explicit ActivationOffloader(Device device);
  ~ActivationOffloader();
  ActivationOffloader(const ActivationOffloader&) = delete;
  ActivationOffloader& operator=(const ActivationOffloader&) = delete;

  // After the forward of offload group `group` (ordered as the backward's reverse: GPTModel passes
  // 2 * layer + part): its defined, contiguous slot tensors go to the host and the slots are
  // cleared. `stash` is created on the micro-batch's first call.
  void offload(std::shared_ptr<ActivationStash>& stash, int64_t group, const std::vector<OffloadSlot>& slots);
  // The end of a micro-batch's forward: the device tensors whose copies have run are handed back
  // (no wait: the others follow as their copies finish).
  void finish_forward();
  // The start of a micro-batch's backward: its highest offload groups start coming back.
  void begin_backward(const std::shared_ptr<ActivationStash>& stash);
  // Before group `group`'s backward: the slots (the list offload got) hold their tensors again,
  // ready on the compute stream; the next groups in backward order start coming back.
  void reload(const std::shared_ptr<ActivationStash>& stash, int64_t group, const std::vector<OffloadSlot>& slots);

 private:
  struct InFlight;
  struct ForwardCopy;
  void create_streams();
  void release_copied_forward();
  void bound_forward_copies();
  void poll_host_buffers(bool wait);
  void start_reload(LayerGroup& g);
  void prefetch_ahead(const std::shared_ptr<ActivationStash>& stash, int64_t budget);

  Device device_;
  int64_t window_;
  Stream d2h_, h2d_;  // GPU: the copies to the host and back (each its own stream: both directions at once)
  bool streams_created_ = false;
  std::deque<std::weak_ptr<ActivationStash>> order_;  // micro-batches with offloaded groups, forward order
  std::deque<ForwardCopy> forward_copies_;             // offloaded groups whose device tensors wait for their copy
  std::deque<std::unique_ptr<InFlight>> host_in_flight_;  // host buffers whose copies may still run
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
