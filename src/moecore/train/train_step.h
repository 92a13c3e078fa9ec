// One training step: global_batch / micro_batch / DP micro-batches of this rank, each forward +
// backward with gradients accumulating in fp32 (through train/pipeline with pipeline stages),
// then the gradient reductions (optimizer.h), the global gradient norm, the MoE statistics over
// the ranks and the MoE layers' end-of-step work (expert-bias update), and the optimizer step:
// a NaN/Inf in the loss or the gradients skips it (reported with the iteration), else global
// gradient-norm clipping and AdamW on the fp32 masters.
//
// Phases (--timing-log-level 1): forward-backward, grads-reduce, grad-norm, moe-statistics,
// moe-finish-step, loss-and-checks, optimizer. The host waits once, for the gradient norm; the
// step's loss and the MoE statistics come back behind it (no wait of their own).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "moecore/core/step_timers.h"
#include "moecore/train/train_setup.h"

namespace moecore {

struct StepResult {
  double lm_loss = 0;    // the step's loss (averaged over DP, summed over the pipeline stages)
  double aux = 0, z = 0;  // balancing and z-loss / coeff, averaged over micro-batches and MoE layers
  std::vector<double> mtp_losses;  // each MTP depth's loss, as lm_loss (--mtp-num-layers)
  double grad_sq = 0;    // the squared global gradient norm
  double grad_norm = 0;  // its square root
  bool skipped = false;  // a NaN or Inf in the loss or the gradients: no optimizer step
  std::vector<MoeStepStats> layer_stats;  // each MoE layer's statistics, reduced over the ranks
  // The step's loss on the device (LossAccumulator::value), held until the iteration ends, so the
  // allocator's statistics in the log line count it as before.
  Tensor loss_on_device;
};

// Step `it` (1-based). Updates run.state (consumed samples, iteration, skipped / NaN counts).
StepResult train_step(TrainingRun& run, int64_t it);

// The MoE layers' step statistics summed over the TP x CP token group and the data-parallel
// group (losses averaged over DP), then each layer's end of step. Opens the phases
// "moe-statistics" and "moe-finish-step" in `phase`.
std::vector<MoeStepStats> reduce_moe_statistics(const std::vector<MoeLayer*>& moe_layers,
                                                comm::Communicator* token_group, comm::Communicator* dp,
                                                std::optional<TimedRegion>& phase, Device dev);

}  // namespace moecore
