// A side stream for work that overlaps the compute stream's (--moe-shared-expert-overlap: the
// shared expert while the routed tokens travel). fork() makes a side stream wait for what the
// current stream has enqueued so far (the work's inputs are ready) and makes it current; leave()
// goes back to the compute stream and records an event after the side stream's work; join() makes
// the compute stream wait for that event before the result is used. One side stream per CUDA
// device and lane for the process: the MoE layers run one after another, so they share it. Lanes:
// SharedExpert (--moe-shared-expert-overlap) and Communication (--overlap-moe-expert-parallel-comm:
// the expert-parallel collectives, train/ep_overlap_schedule.h).
//
// Memory: the caching allocator keys its free blocks by the allocating stream, so blocks the side
// work allocates are reused by later side work only, which forks after the compute stream's reads
// of them; inputs from the compute stream must stay alive until join() (the caller holds them).
// On the CPU (or with `on` false) nothing forks: the work runs inline, in the order it is issued.
#pragma once

#include <memory>
#include <optional>

#include "moecore/core/device.h"

namespace moecore {

enum class SideLane { SharedExpert, Communication };

class SideStream {
 public:
  SideStream() = default;
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  void fork(Device device, bool on, SideLane lane = SideLane::SharedExpert);
  void leave();
  void join();

 private:
  Device device_;
  std::optional<StreamGuard> guard_;
  std::unique_ptr<Event> done_;
};

}  // namespace moecore
