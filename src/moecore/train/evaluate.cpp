#include "moecore/train/evaluate.h"

#include "moecore/core/step_timers.h"
#include "moecore/train/pipeline.h"

namespace moecore {

double evaluate(TrainingRun& run) {
  const TrainArgs& args = run.args;
  set_timing_level(0);  // the timers cover training steps only
  double vsum = 0;
  for (int64_t e = 0; e < args.eval_iters; ++e) {
    const Batch b =
        run.context_parallel_batch(run.data.valid->batch(e * args.micro_batch_size, args.micro_batch_size, run.dev));
    GPTModel::Ctx ctx;
    if (!run.pp) {
      vsum += run.model().forward(b.tokens, b.labels, false, 0, ctx);
      continue;
    }
    // Forward only, stage to stage; the loss appears on the last stage (where the logger is).
    vsum += pipeline_forward_only(run.chunks, *run.pp, b);
  }
  // The evaluation forwards' deferred routing checks (nothing else reads them after the last one).
  for (MoeLayer* l : run.moe_layers) l->check_evaluation_routing();
  set_timing_level(static_cast<int>(args.timing_log_level));
  return vsum / static_cast<double>(args.eval_iters);
}

}  // namespace moecore
