#include "moecore/train/step_decisions.h"

#include <algorithm>
#include <vector>

#include "moecore/ops/adamw.h"
#include "moecore/ops/elementwise.h"
#include "moecore/train/lr_schedule.h"

namespace moecore {

void StepDecisions::decide(const TrainArgs& args, const TrainingState& state, int64_t it, const Tensor& grad_sq_parts,
                           const Tensor& loss, Device dev) {
  prepare(args, state, it, dev);
  decide_on_device(args, grad_sq_parts, loss);
  table_ = Tensor();  // the upload goes back to the allocator now (enqueued work keeps its order)
}

void StepDecisions::prepare(const TrainArgs& args, const TrainingState& state, int64_t it, Device dev,
                            int64_t table_rows) {
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
  MC_CHECK(table_rows == 0 || table_rows >= rows, "StepDecisions::prepare: ", rows, " candidate rows for a table of ",
           table_rows);
  const int64_t table = table_rows > 0 ? table_rows : rows;
  std::vector<double> candidates(static_cast<size_t>(table * 4));
  for (int64_t c = 0; c < table; ++c) {
    const int64_t done = it - 1 - state.skipped_iterations - std::min(c, rows - 1) - state.optimizer_offset;
    ops::adamw_candidate(learning_rate(args, done), done + 1, d, args.weight_decay, &candidates[static_cast<size_t>(c * 4)]);
  }
  const Tensor host = Tensor::from_vector(candidates, {table, 4});
  if (table_rows > 0) {
    if (!fixed_table_.defined() || fixed_table_.size(0) != table_rows)
      fixed_table_ = Tensor::empty({table_rows, 4}, DType::F64, dev);
    if (dev.is_cpu()) {
      fixed_table_.copy_from(host);
    } else {
      uploader_.upload_into(host, fixed_table_);
    }
    table_ = fixed_table_;
  } else {
    table_ = dev.is_cpu() ? host : uploader_.upload(host, dev);
  }
  ++unresolved_;
}

void StepDecisions::decide_on_device(const TrainArgs& args, const Tensor& grad_sq_parts, const Tensor& loss) {
  const ops::AdamWDecision d{args.adam_beta1, args.adam_beta2, args.adam_eps, args.clip_grad};
  ops::decide_adamw_step(grad_sq_parts, loss, table_, d, skips_, step_, report_);
}

void StepDecisions::resolved() {
  if (unresolved_ == 0) return;
  ops::fill(skips_, 0.0);
  unresolved_ = 0;
}

}  // namespace moecore
