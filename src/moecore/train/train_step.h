// One training step: global_batch / micro_batch / DP micro-batches of this rank, each forward +
// backward with gradients accumulating in fp32 (through train/pipeline with pipeline stages),
// then the gradient reductions (optimizer.h), the global gradient norm, the MoE statistics over
// the ranks and the MoE layers' end-of-step work (expert-bias update), and the optimizer step:
// a NaN/Inf in the loss or the gradients skips it, else global gradient-norm clipping and AdamW
// on the fp32 masters -- decided on the device (step_decisions.h), so that the host does not wait
// for the gradient norm. The step's loss, gradient norm and skip reach the host later:
// resolve_step (TrainMetrics calls it at a log step) reads them and counts a skip in run.state.
//
// Without pipeline stages the MoE layers' statistics stay on the device too (reduced over the
// ranks by device collectives, the expert-bias update applied there) and are read with the rest.
//
// Phases (--timing-log-level 1): forward-backward, grads-reduce, grad-norm, moe-statistics,
// moe-finish-step, loss-and-checks, optimizer. Host waits left in a step: with pipeline stages the
// loss's and the MoE statistics' reads (the stages sum them on the host); the norm's cross-rank
// sums of the layouts other than one rank or replicated DP (host collectives).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "moecore/core/host_transfer.h"
#include "moecore/core/step_timers.h"
#include "moecore/train/train_setup.h"

namespace moecore {

// Each step's values that reach the host after the step (resolve_step).
struct PendingStepValues {
  PendingRead report;            // StepDecisions::report(): {loss, grad_sq, skipped}
  std::vector<PendingRead> mtp;  // each MTP depth's loss (without pipeline stages)
  // Without pipeline stages: each MoE layer's packed statistics (MoeStats::pack_step_stats) and
  // its micro-batch count.
  std::vector<PendingRead> moe;
  std::vector<int64_t> moe_micro_batches;
};

struct StepResult {
  int64_t iteration = 0;
  // Until resolve_step: lm_loss, mtp_losses (without pipeline stages), grad_sq, grad_norm and
  // skipped are not set; pending holds their reads (null once resolved).
  std::unique_ptr<PendingStepValues> pending;
  double lm_loss = 0;    // the step's loss (averaged over DP, summed over the pipeline stages)
  double aux = 0, z = 0;  // balancing and z-loss / coeff, averaged over micro-batches and MoE layers
  std::vector<double> mtp_losses;  // each MTP depth's loss, as lm_loss (--mtp-num-layers)
  double grad_sq = 0;    // the squared global gradient norm
  double grad_norm = 0;  // its square root
  bool skipped = false;  // a NaN or Inf in the loss or the gradients: no optimizer step
  std::vector<MoeStepStats> layer_stats;  // each MoE layer's statistics, reduced over the ranks (resolved)
};

// What a step captured into a CUDA graph does differently (train/train_graph.h; one rank, no
// pipeline stages): its micro-batches come from `batch` (fixed device buffers the host filled
// before the launch), run.decisions.prepare() has run (the candidates in the fixed table), and
// the device values the host reads after the step are left in `outputs` instead of read (the
// graph's caller starts the reads after each launch).
struct StepGraphHooks {
  std::function<Batch(int64_t)> batch;
  struct Outputs {
    Tensor report;                         // StepDecisions::report()
    std::vector<Tensor> mtp;               // each MTP depth's loss
    std::vector<Tensor> moe;               // each MoE layer's packed statistics
    std::vector<int64_t> moe_micro_batches;
  } outputs;
};

// Step `it` (1-based). Updates run.state (consumed samples, iteration). hooks: under a CUDA graph.
StepResult train_step(TrainingRun& run, int64_t it, StepGraphHooks* hooks = nullptr);
// The reads of a step's device values (pending of a StepResult), started now on the current stream.
std::unique_ptr<PendingStepValues> start_step_reads(const StepGraphHooks::Outputs& outputs);
// Takes the step's pending values (waiting only if they have not arrived) and, for a skipped step,
// prints the NaN/Inf line and counts it in run.state (skipped / NaN counts). Steps are resolved in
// order, every decided step before run.decisions.resolved().
void resolve_step(TrainingRun& run, StepResult& r);

// The MoE layers' step statistics summed over the TP x CP token group and the data-parallel
// group (losses averaged over DP), then each layer's end of step. Opens the phases
// "moe-statistics" and "moe-finish-step" in `phase`.
std::vector<MoeStepStats> reduce_moe_statistics(const std::vector<MoeLayer*>& moe_layers,
                                                comm::Communicator* token_group, comm::Communicator* dp,
                                                std::optional<TimedRegion>& phase, Device dev);

}  // namespace moecore
