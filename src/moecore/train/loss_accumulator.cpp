#include "moecore/train/loss_accumulator.h"

#include "moecore/core/error.h"
#include "moecore/ops/elementwise.h"

namespace moecore {

LossAccumulator::LossAccumulator(int64_t micro_batches, Device device, DType dtype)
    : micro_batches_(micro_batches), total_(Tensor::zeros({1}, dtype, device)) {
  MC_CHECK(micro_batches >= 1, "LossAccumulator: ", micro_batches, " micro-batches; expected >= 1");
}

void LossAccumulator::add(const Tensor& sum, int64_t labelled) {
  if (!sum.defined() || labelled <= 0) return;
  MC_CHECK(sum.numel() == 1 && sum.dtype() == total_.dtype() && sum.device() == total_.device(),
           "LossAccumulator::add: expected a one-element ", dtype_name(total_.dtype()), " tensor on ",
           total_.device().str(), ", got ", sum.describe());
  // The scale is rounded to f32 (the op's alpha): a relative change of at most 2^-24 in the
  // logged loss, which the host computed in f64 before.
  const double scale = 1.0 / (static_cast<double>(labelled) * static_cast<double>(micro_batches_));
  ops::axpby(static_cast<float>(scale), sum.view({1}), 1.0f, total_, total_);
}

}  // namespace moecore
