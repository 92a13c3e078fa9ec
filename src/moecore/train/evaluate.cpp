#include "moecore/train/evaluate.h"

#include "moecore/core/step_timers.h"
#include "moecore/train/pipeline.h"

namespace moecore {

double evaluate_samples(TrainingRun& run, const DataSource& data, int64_t samples) {
  const TrainArgs& args = run.args;
  set_timing_level(0);  // the timers cover training steps only
  const int64_t mbs = args.micro_batch_size, full = samples / mbs, rest = samples % mbs;
  auto batch_loss = [&](int64_t first, int64_t count) -> double {
    const Batch b = run.context_parallel_batch(data.batch(first, count, run.dev));
    GPTModel::Ctx ctx;
    if (!run.pp) return run.model().forward(b.tokens, b.labels, false, 0, ctx);
    // Forward only, stage to stage; the loss appears on the last stage (where the logger is).
    return pipeline_forward_only(run.chunks, *run.pp, b);
  };
  double vsum = 0;
  for (int64_t e = 0; e < full; ++e) vsum += batch_loss(e * mbs, mbs);
  double batches = static_cast<double>(full);
  if (rest > 0) {
    const double weight = static_cast<double>(rest) / static_cast<double>(mbs);
    vsum += batch_loss(full * mbs, rest) * weight;
    batches += weight;
  }
  // The evaluation forwards' deferred routing checks (nothing else reads them after the last one).
  for (MoeLayer* l : run.moe_layers) l->check_evaluation_routing();
  set_timing_level(static_cast<int>(args.timing_log_level));
  return vsum / batches;
}

double evaluate(TrainingRun& run) {
  return evaluate_samples(run, *run.data.valid, run.args.eval_iters * run.args.micro_batch_size);
}

}  // namespace moecore
