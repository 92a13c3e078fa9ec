// Megatron's learning-rate schedule (OptimizerParamScheduler):
//   warm-up:  lr * step / warmup            for step <= warmup
//   decay over (warmup, decay_iters] from lr to min_lr:
//     constant  lr
//     linear    min + (lr - min) * (1 - r)            r = (step - warmup) / (decay - warmup)
//     cosine    min + (lr - min) * 0.5 * (1 + cos(pi r))
//     WSD       lr until decay - wsd_decay, then to min_lr over the last wsd_decay steps with
//               coefficient c(w) of w = progress in [0, 1] (--lr-wsd-decay-style):
//               linear 1 - w, cosine 0.5 (1 + cos(pi w)), exponential 2 * 0.5^w - 1, minus_sqrt 1 - sqrt(w)
//   after decay_iters: min_lr.
#pragma once

#include "moecore/train/arguments.h"

namespace moecore {

// The learning rate after `steps` completed optimizer steps (the step that follows uses it;
// Megatron's OptimizerParamScheduler.get_lr with num_steps = steps).
double learning_rate(const TrainArgs& args, int64_t steps);

}  // namespace moecore
