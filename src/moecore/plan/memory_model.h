// The planner's memory model: one rank's peak memory, split into the parts of `moecore train
// --memory-report` (core/memory_categories.h), for any layout the train command accepts.
//
// It follows the code rather than a rule of thumb: the model state is what ParamStore and the
// optimizer allocate (flat gradient and master buffers, AdamW moments, the distributed
// optimizer's shards, bf16 weights with split masters), the activations are the tensors each
// module's forward keeps in its Ctx (model/, moe/), per micro-batch in flight on the stage (1F1B:
// the warm-up depth + 1; interleaved: the warm-up's chunk forwards + 1), and the workspace is the
// gradients alive in the experts' backward of the first backward (where the step peaks). Each
// tensor is rounded as the allocator rounds it. Dropless MoE routes a varying number of tokens to
// each expert: the model takes the expected, balanced count (every rank gets tokens x top-k rows).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "moecore/core/memory_categories.h"
#include "moecore/train/arguments.h"

namespace moecore::plan {

struct PlanOptions {
  bool fp8 = false;          // --fp8-recipe blockwise (a prediction: GEMMs at the FP8 peak, which training does not reach yet)
  bool ep_overlap = false;   // --overlap-moe-expert-parallel-comm (step: a prediction; memory: its pairs without PP)
  bool flex_dispatch = false;  // --moe-token-dispatcher-type flex (a prediction: DeepEP-style, not in training)
  // --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split (Megatron's;
  // a prediction): the first / last of num_layers is the embedding's / the loss's slot, not a
  // layer. The step model skips them; the memory model counts them as layers (an upper bound).
  bool embedding_slot = false, loss_slot = false;
  bool whole_run_peak = false;  // the CPU allocator's peak counts the set-up too (a GPU's is per step)
  bool offload_copies_synchronous = false;  // --offload-modules on the CPU: a layer's device tensors go at once
  // A GPU profile: the fused output layer's peak is one chunk of logits (cuBLASLt multiplies bf16
  // operands into fp32 gradients directly; the CPU GEMM widens the whole chunk's logits to fp32).
  bool gpu_head_chunks = false;
};

// Bytes by tag (core/memory_categories.h) and the allocator's rounding of them.
struct MemoryParts {
  std::array<double, kNumMemoryTags> by_tag{};
  double rounding = 0;
  double category(MemoryCategory c) const;
  double tagged() const;
  double total() const { return tagged() + rounding; }  // the allocator's peak
};

struct StageMemory {
  int64_t stage = 0;           // pipeline rank
  int64_t in_flight = 0;       // chunk forwards whose activations are alive at the peak
  std::string peak_at;         // "step" or "setup"
  MemoryParts parts;           // at the peak
  double host_offloaded = 0;   // --offload-modules: the in-flight layers' offloaded bytes on the host
  MemoryParts host;            // --optimizer-cpu-offload: the host part of the optimizer (not in the peak)
  double state_params = 0;     // parameters on the rank
};

// One entry per pipeline stage (every TP / CP / EP / DP rank of a stage is alike under the
// balanced-routing assumption). a: finalized train arguments (parse_train_args).
std::vector<StageMemory> predict_memory(const TrainArgs& a, const PlanOptions& o);

// The parameters of one pipeline rank: dense (split over TP) and experts (over EP x ETP).
struct RankParams {
  double dense = 0, expert = 0;
  std::vector<double> tensors;  // each parameter's elements on the rank
  std::vector<double> dense_tensors, expert_tensors;  // the same by kind, in the gradient buffers' order
  double total() const { return dense + expert; }
};
RankParams rank_params(const TrainArgs& a, int64_t stage);

}  // namespace moecore::plan
