// Named regions of a training step, timed without waiting for the GPU (Megatron's
// --timing-log-level).
//
// A TimedRegion records an event on its device's current stream when it opens and when it
// closes; collect_region_times() reads the elapsed times once the step has synchronised, so
// timing adds no host waits. On the CPU the events read the host clock. A region's time is an
// interval of the GPU's timeline: it includes the time the GPU sat idle inside it (waiting for
// the host to enqueue work, e.g. while the host waits for a statistic or an MPI call). Times are
// inclusive (a region contains the regions opened inside it) and follow the current stream
// only: work on another stream (a gradient reduction overlapped on the communication stream)
// counts where the current stream waits for it. The state is per thread (the training loop's).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/core/device.h"

namespace moecore {

// 0: off (the default), 1: the step's phases (forward-backward, gradient reduction, norm,
// optimizer), 2: also the model's parts (attention, MoE router / dispatch / experts / combine,
// output layer), forward and backward separately, summed over layers and micro-batches.
void set_timing_level(int level);
int timing_level();

class TimedRegion {
 public:
  // Timed when level <= timing_level(); `name` must outlive the step (a string literal).
  TimedRegion(const char* name, int level, Device device);
  ~TimedRegion();
  TimedRegion(const TimedRegion&) = delete;
  TimedRegion& operator=(const TimedRegion&) = delete;

 private:
  int record_ = -1;  // index of this region's pending record; -1: not timed
};

struct RegionTime {
  std::string name;
  int depth = 0;  // nesting depth when first opened (0: outermost)
  double ms = 0;  // summed since the last take_region_times()
  int64_t calls = 0;
};

// Adds the time of every region closed since the last call to the totals. Reads finished
// events only (an unfinished one is an error): call it after the step's own synchronisation.
void collect_region_times();
// The regions timed since the last take (collected first) with their totals, in the order the
// regions were first opened; resets the totals.
std::vector<RegionTime> take_region_times();

}  // namespace moecore
