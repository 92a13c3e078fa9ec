// The setup of `moecore train`: everything a run holds between its steps, built once in a fixed
// order (every rank issues the same collectives in the same order):
//   1. the world communicator (data parallelism: every launched rank trains its share of each
//      global batch), the same-flags check over it, and the process groups (ProcessGroups:
//      Parallel Folding's dense and expert groups, owned there);
//   2. this rank's model chunks (its pipeline stage's virtual stages) on one ParamStore;
//   3. the optimizer over the store (overlap, distributed shards, parameter-gather waits);
//   4. the checkpoint named by --load, if any (checkpoint_transfer.h);
//   5. the data sources (mock data or GPT datasets).
// print_run_summary() then counts the parameters over the stages and prints the start lines.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/core/host_transfer.h"
#include "moecore/model/fp8_linear.h"
#include "moecore/model/gpt.h"
#include "moecore/parallel/process_groups.h"
#include "moecore/train/arguments.h"
#include "moecore/train/checkpoint.h"
#include "moecore/train/data_source.h"
#include "moecore/train/optimizer.h"
#include "moecore/train/step_decisions.h"

namespace moecore {

// Sums v over the group in place; a null communicator means one rank.
void sum_over_ranks(comm::Communicator* c, std::vector<double>& v);

class TrainingRun {
 public:
  explicit TrainingRun(const TrainArgs& args);  // steps 1-5 above; collective
  ~TrainingRun();
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  const TrainArgs& args;
  const ModelConfig& cfg;
  const Device dev;

  // Declared first, so destroyed last (after the model and the optimizer that use them).
  std::unique_ptr<parallel::ProcessGroups> groups;
  comm::Communicator* pp = nullptr;  // groups->pp(): the pipeline group (null: one stage)
  comm::Communicator* dp = nullptr;  // groups->dp(): the data-parallel group
  int64_t dp_size = 1, dp_rank = 0;
  int64_t stage = 0, stages = 1, vstages = 1;  // pipeline rank, pipeline size, chunks per rank
  bool logger = false;  // Megatron logs from the last rank (last stage)
  bool writer = false;  // and saves from the first
  bool has_head = false;  // this rank's last chunk holds the output layer (and the loss)

  std::vector<PipelineStage> chunk_stages;  // one per model chunk of this rank
  std::string stage_sizes;                  // layers per pipeline rank, for the log ("2/2")
  DType compute = DType::F32;
  std::unique_ptr<Fp8Context> fp8;  // FP8 training (model/fp8_linear.h); null when off
  std::unique_ptr<ParamStore> store;
  std::vector<std::unique_ptr<GPTModel>> chunk_models;
  std::vector<GPTModel*> chunks;
  std::unique_ptr<Optimizer> optimizer;
  TrainingState state;
  StepDecisions decisions;  // the optimizer steps' device-side decisions (step_decisions.h)
  DataSources data;

  int64_t micro = 1;  // micro-batches of this rank per step
  int64_t tokens_per_step = 0;
  double flops_per_step = 0;
  std::vector<MoeLayer*> moe_layers;  // every chunk's, in chunk order
  std::vector<int64_t> moe_numbers;   // their layer numbers

  GPTModel& model() { return *chunks.front(); }
  // Context parallelism: this rank's two chunks of every sequence.
  Batch context_parallel_batch(Batch b) const;
  // Training micro-batches are checked and their labels counted on the host, then go up through
  // pinned memory: neither the upload nor the forward waits for the GPU (GPTModel::Ctx::
  // checked_num_labels). With multi-token prediction the stage with the output layer also gets
  // each depth's shifted tokens and labels, made from the whole sequences before the CP split.
  Batch checked_upload(Batch host);
  // The same into fixed device buffers (a CUDA graph's, train/train_graph.h; one rank, no MTP):
  // `host` checked, its tokens and labels copied into fixed.tokens / fixed.labels; returns its
  // labelled tokens.
  int64_t checked_upload_into(const Batch& host, Batch& fixed);

 private:
  void open_groups();
  void build_model();

  PinnedUploader uploader_;
};

// The whole model's parameter count (collective over the pipeline group), then the start lines
// (from the logging rank).
void print_run_summary(const TrainingRun& run);

}  // namespace moecore
