#include "moecore/train/step_decisions.h"

#include <vector>

#include "moecore/ops/adamw.h"
#include "moecore/ops/elementwise.h"
#include "moecore/train/lr_schedule.h"

namespace moecore {

void StepDecisions::decide(const TrainArgs& args, const TrainingState& state, int64_t it, const Tensor& grad_sq_parts,
                           const Tensor& loss, Device dev) {
  if (!scalars_.defined()) {  // one small block for the run: {step, skip counter, report}
    constexpr int64_t n = ops::kAdamWDeviceStepWords;
    scalars_ = Tensor::zeros({n + 4}, DType::F64, dev);
    step_ = scalars_.slice(0, 0, n);
    skips_ = scalars_.slice(0, n, n + 1);
    report_ = scalars_.slice(0, n + 1, n + 4);
  }
  const ops::AdamWDecision d{args.adam_beta1, args.adam_beta2, args.adam_eps, args.clip_grad};
  // Row c: c of the unresolved steps were skipped. The step after n successful steps uses lr(n)
  // and AdamW step n + 1 (as the host decided it: train_step).
  const int64_t rows = unresolved_ + 1;
  std::vector<double> candidates(static_cast<size_t>(rows * 4));
  for (int64_t c = 0; c < rows; ++c) {
    const int64_t done = it - 1 - state.skipped_iterations - c - state.optimizer_offset;
    ops::adamw_candidate(learning_rate(args, done), done + 1, d, args.weight_decay, &candidates[static_cast<size_t>(c * 4)]);
  }
  const Tensor host = Tensor::from_vector(candidates, {rows, 4});
  const Tensor table = dev.is_cpu() ? host : uploader_.upload(host, dev);
  ops::decide_adamw_step(grad_sq_parts, loss, table, d, skips_, step_, report_);
  ++unresolved_;
}

void StepDecisions::resolved() {
  if (unresolved_ == 0) return;
  ops::fill(skips_, 0.0);
  unresolved_ = 0;
}

}  // namespace moecore
