// What a training run reports: Megatron's per-iteration log line (from the last rank), one JSON
// object per log step in --metrics-file (metrics.jsonl), TensorBoard scalars (--tensorboard-dir),
// the per-region timers (--timing-log-level) and the validation lines.
//
// Values over a log interval (--log-interval steps): the time per iteration is the wall time from
// the interval's start to the host's wait at its log step, less the evaluations and checkpoints
// in it, over its steps; lm loss and the balancing losses are averaged over the steps that were
// not skipped; skipped / NaN steps are counted per interval (as Megatron logs them); host
// synchronisations are counted in the steps (core/device.h) and logged per iteration. The host
// waits for the device at a log step only (and at each step with --timing-log-level, whose
// timers read their events): the steps' losses, gradient norms and skips (decided on the device)
// are read there, the NaN/Inf lines and health warnings printed there, for each step in order.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <fstream>
#include <memory>

#include "moecore/train/tensorboard.h"
#include "moecore/train/train_setup.h"
#include "moecore/train/train_step.h"

namespace moecore {

// Whether step `it` ends a log interval (every --log-interval steps and the last step).
bool is_log_step(const TrainArgs& args, int64_t it);

// What a step says about training health (TrainMetrics warns about the last two): a step that
// cannot change the model has every gradient exactly zero, or the loss bit-identical to the
// previous step's (previous_loss, when have_previous) with a gradient norm below 1e-8.
// A skipped (NaN/Inf) step is kLearning here: it is reported as such.
enum class StepHealth { kLearning, kZeroGradients, kConstantLoss };
StepHealth step_health(const StepResult& step, bool have_previous, double previous_loss);

class TrainMetrics {
 public:
  // Opens the TensorBoard writer and the metrics file on the logging rank (an Error naming
  // --metrics-file when it cannot be opened).
  TrainMetrics(const TrainArgs& args, bool logger);
  ~TrainMetrics();

  // The first interval starts now.
  void start_interval();
  // After step `it` (syncs0: host_synchronizations() when it began): accounts the step and, at a
  // log step, waits for the device and writes the line, the JSONL object and the scalars.
  // Collective at a log step (the parameter norm). Returns whether it was a log step.
  // The step's values reach the host only then: every step since the last log step is resolved
  // (train_step.h: resolve_step) and accounted there, in order.
  bool end_step(TrainingRun& run, int64_t it, StepResult step, uint64_t syncs0);
  // Resolves and accounts the steps not yet read (reads that wait unless the device has finished
  // them): before a checkpoint (run.state's skip counts) or an evaluation.
  void resolve_steps(TrainingRun& run);
  // Time spent on evaluation or checkpoints after step `it`: not the interval's.
  void exclude_ms(double ms) { interval_excluded_ms_ += ms; }
  // The validation line, JSONL object and scalar of `it`.
  void log_validation(int64_t it, double vloss);

 private:
  struct Interval;  // the averages of the interval that ends at a log step
  void write_log_step(TrainingRun& run, int64_t it, const StepResult& step, const Interval& v);
  // A warning line (logging rank) for a step whose gradients are all zero, or whose loss repeats
  // the previous step's exactly with a vanishing gradient norm.
  void check_health(int64_t it, const StepResult& step, bool log_now);
  void account_step(TrainingRun& run, StepResult& step);  // one resolved step into the interval
  // --memory-report at the first log step: every rank's report to the logging rank (collective).
  void write_memory_report(TrainingRun& run, int64_t it);

  using Clock = std::chrono::steady_clock;
  bool logger_ = false;
  std::unique_ptr<TensorBoardWriter> tb_;
  std::ofstream metrics_;
  double interval_loss_ = 0;
  int64_t interval_steps_ = 0, interval_skipped_ = 0, interval_nan_ = 0;  // Megatron logs these per interval
  int64_t interval_loss_steps_ = 0;  // steps whose loss enters the average (not the skipped ones)
  uint64_t interval_syncs_ = 0;      // host synchronisations in the interval's steps (core/device.h)
  double interval_aux_ = 0, interval_z_ = 0;  // balancing losses, averaged over the interval like lm loss
  std::vector<double> interval_mtp_;  // each MTP depth's loss, averaged like lm loss
  Clock::time_point interval_start_ = Clock::now();
  double interval_excluded_ms_ = 0;
  double previous_loss_ = 0;  // check_health: the last step's loss
  bool have_previous_loss_ = false;
  int64_t stalled_steps_ = 0;
  bool memory_reported_ = false;
  std::deque<StepResult> unresolved_;  // the steps since the last read, in order
  StepResult last_;                    // the last resolved step (the log line's grad norm, MoE layers)
};

}  // namespace moecore
