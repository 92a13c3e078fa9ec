// The optimizer step's decisions on the device (ops/adamw.h: decide_adamw_step): global gradient-
// norm clipping and the NaN/Inf skip, from the gradient norm and the loss where they are, without a
// host wait. The host learns each step's outcome later (TrainMetrics resolves the steps at a log
// step, or before an evaluation or a checkpoint: resolve_step below). Until then the learning rate
// and the AdamW step count of a new step depend on how many of the unresolved steps were skipped
// (Megatron's scheduler does not count skipped steps), which only the device knows: each step
// uploads one candidate row per possible count (at most the unresolved steps + 1), and the device
// picks the row of its own skip counter.
//
// Under a CUDA graph (train/train_graph.h) the host part and the device part come apart: prepare()
// writes the step's candidates into a fixed table of table_rows rows (the rows past the
// unresolved steps + 1 repeat the last one; never picked) before the graph's launch, and the
// captured step runs decide_on_device(), which reads that table.
#pragma once

#include <cstdint>

#include "moecore/core/host_transfer.h"
#include "moecore/core/tensor.h"
#include "moecore/train/arguments.h"
#include "moecore/train/checkpoint_meta.h"

namespace moecore {

class StepDecisions {
 public:
  // Decides step `it` on `dev`: grad_sq_parts and loss as ops::decide_adamw_step takes them; the
  // candidates follow state (the skips the host has resolved) and the unresolved steps. Then
  // Optimizer::step(hyper, device_step()).
  void decide(const TrainArgs& args, const TrainingState& state, int64_t it, const Tensor& grad_sq_parts,
              const Tensor& loss, Device dev);
  // decide() in two parts: prepare (host; table_rows > 0: into the fixed table of that many rows,
  // which must exceed unresolved()) and decide_on_device (the device's part).
  void prepare(const TrainArgs& args, const TrainingState& state, int64_t it, Device dev, int64_t table_rows = 0);
  void decide_on_device(const TrainArgs& args, const Tensor& grad_sq_parts, const Tensor& loss);
  const Tensor& device_step() const { return step_; }
  // The last decided step's {loss or 0, grad_sq, skipped (0 / 1)} (f64 [3], overwritten by the
  // next decision in stream order: start a PendingRead of it before then).
  const Tensor& report() const { return report_; }
  // Every decided step has been accounted on the host (state.skipped_iterations counts its skips):
  // the device's counter restarts (an enqueued fill: no wait).
  void resolved();
  int64_t unresolved() const { return unresolved_; }

 private:
  Tensor scalars_;                 // f64: the three below, one allocation
  Tensor step_, skips_, report_;
  Tensor table_;        // the candidates decide_on_device reads: the last upload, or fixed_table_
  Tensor fixed_table_;  // the table of table_rows rows (a graph's: its address stays)
  int64_t unresolved_ = 0;  // steps decided since the last resolved()
  PinnedUploader uploader_;
};

}  // namespace moecore
