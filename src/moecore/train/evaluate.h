// Validation during training (--eval-interval, --eval-iters): forward only over the first
// eval_iters micro-batches of the validation data, through the pipeline stages when there are
// any; the loss appears on the last stage (where the logger is). The step timers are off while it
// runs (they cover training steps only).
#pragma once

#include "moecore/train/train_setup.h"

namespace moecore {

// The mean validation loss (meaningful on the rank holding the last stage). Collective over the
// pipeline group.
double evaluate(TrainingRun& run);

}  // namespace moecore
