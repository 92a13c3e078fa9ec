// A training step's lm loss, kept on the device: the average over the step's micro-batches of
// each micro-batch's mean loss over its labelled tokens (Megatron's reported lm loss). Adding a
// micro-batch reads nothing back, so the host never waits for its forward.
#pragma once

#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore {

class LossAccumulator {
 public:
  // dtype: the models' loss dtype (f32; f64 for f64 models).
  LossAccumulator(int64_t micro_batches, Device device, DType dtype);
  // sum: one micro-batch's summed token losses ([1] on the device: GPTModel::forward_loss_sum)
  // over `labelled` tokens; adds sum / (labelled * micro_batches). Nothing for labelled = 0 (the
  // micro-batch's mean is 0) or an undefined sum (a stage without the head).
  void add(const Tensor& sum, int64_t labelled);
  // [1] on the device: the mean so far.
  Tensor& value() { return total_; }

 private:
  int64_t micro_batches_;
  Tensor total_;
};

}  // namespace moecore
