// A lower bound of the memory one rank needs for the model's state: the weights (fp32 masters,
// bf16 compute copies), their gradients and AdamW's two moments, split over the parallel layout.
// Activations, buffers and the allocator's slack come on top, so a layout whose bound exceeds
// the device's memory cannot run; the train command refuses it before building anything, and a
// planner can rank layouts with the same numbers.
#pragma once

#include <cstdint>

#include "moecore/model/config.h"

namespace moecore {

struct StateLayout {
  int64_t tp = 1, pp = 1, ep = 1, etp = 1, dp = 1;
  bool distributed_optimizer = false;  // AdamW moments (and masters) sharded over dp
  bool bf16 = false;                   // bf16 compute copies beside the fp32 masters
  int64_t exp_avg_bytes = 4, exp_avg_sq_bytes = 4;
};

struct StateMemory {
  int64_t params = 0;          // the whole model's parameters
  double params_per_rank = 0;  // the most any rank holds (dense over tp x pp, experts over ep x etp x pp)
  double bytes_per_rank = 0;   // weights + gradients + AdamW moments on that rank
};

// cfg: a finalized ModelConfig.
StateMemory estimate_state_memory(const ModelConfig& cfg, const StateLayout& layout);

// The memory one rank may use: a GPU's own memory, or on the CPU the machine's memory shared by
// local_ranks ranks. 0 when unknown.
double device_memory_bytes(bool cuda, int device_index, int64_t local_ranks);

}  // namespace moecore
