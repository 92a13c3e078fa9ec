// Validation during training (--eval-interval, --eval-iters) and `moecore eval`: forward only
// over the first samples of a data source in micro-batches of --micro-batch-size, through the
// pipeline stages when there are any; the loss appears on the last stage (where the logger is).
// The step timers are off while it runs (they cover training steps only).
#pragma once

#include "moecore/train/train_setup.h"

namespace moecore {

// The mean validation loss over the first eval_iters micro-batches of the validation data
// (meaningful on the rank holding the last stage). Collective over the pipeline group.
double evaluate(TrainingRun& run);

// The mean loss over samples [0, samples) of `data`: full micro-batches of --micro-batch-size,
// then one smaller batch for the rest, weighted by its samples (every sample has seq_length
// labels, so this is the mean over tokens). With whole micro-batches only it is evaluate()'s sum
// over batches divided by their number, bit for bit. Collective over the pipeline group.
double evaluate_samples(TrainingRun& run, const DataSource& data, int64_t samples);

}  // namespace moecore
