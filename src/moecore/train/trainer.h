// `moecore train`: the training loop on one device.
//
// Per step: global_batch / micro_batch micro-batches, each forward + backward with gradients
// accumulating in fp32; a NaN/Inf in the loss or the gradients skips the step (reported with
// the iteration, counted in the log); global gradient-norm clipping; AdamW on the fp32 masters;
// compute copies refreshed; MoE end-of-step work (expert-bias update). Logs Megatron's
// iteration line, a JSONL metrics file and TensorBoard scalars; validates every
// --eval-interval steps; saves every --save-interval steps and after the last one.
//
// The parts: train_setup (communicators through parallel/process_groups, model chunks,
// optimizer, --load, data sources), train_step (forward-backward over the micro-batches, the
// reductions, clipping / NaN skip, AdamW), metrics (log line, metrics.jsonl, TensorBoard,
// timers), evaluate (validation), checkpoint_transfer (save / load over pipeline stages). This
// file holds the loop that calls them.
#pragma once

#include <cstdint>

#include "moecore/model/config.h"
#include "moecore/train/arguments.h"

namespace moecore {

// Model FLOPs per step (the MFU numerator): 6 x active matmul parameters (output head
// included, input embedding excluded) x tokens + 6 x layers x seq x hidden x tokens; the MTP
// modules count as layers (with their eh_proj and another pass through the output head).
double model_flops_per_step(const ModelConfig& cfg, int64_t tokens_per_step);
int64_t active_matmul_params(const ModelConfig& cfg);

int run_training(const TrainArgs& args);

}  // namespace moecore
