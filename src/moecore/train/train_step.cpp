#include "moecore/train/train_step.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>

#include "moecore/comm/communicator.h"
#include "moecore/core/host_transfer.h"
#include "moecore/core/memory_categories.h"
#include "moecore/ops/adamw.h"
#include "moecore/train/ep_overlap_schedule.h"
#include "moecore/train/loss_accumulator.h"
#include "moecore/train/pipeline.h"

namespace moecore {

namespace {

// Every micro-batch's forward and backward (the loss of each into `losses`), through the pipeline
// schedule when there are stages, or the expert-parallel overlap schedule (train/ep_overlap_schedule.h)
// with --overlap-moe-expert-parallel-comm.
void forward_backward(TrainingRun& run, int64_t it, LossAccumulator& losses, std::vector<LossAccumulator>* mtp_losses,
                      const StepGraphHooks* hooks) {
  const TrainArgs& args = run.args;
  const int64_t micro = run.micro, dp_size = run.dp_size, dp_rank = run.dp_rank;
  Optimizer& optimizer = *run.optimizer;
  // Megatron's order: micro-batch m of the step is [dp rank 0's samples | dp rank 1's | ...];
  // its seed is the same on every pipeline stage and equals the single-rank run's.
  auto batch_of = [&](int64_t m) {
    if (hooks) return hooks->batch(m);  // fixed buffers, filled before the graph's launch
    const MemoryCategoryScope module(ActivationModule::kBatch);
    return run.checked_upload(run.data.train->batch(
        run.state.consumed_samples + (m * dp_size + dp_rank) * args.micro_batch_size, args.micro_batch_size,
        Device::cpu()));
  };
  auto rng_of = [&](int64_t m) {
    return static_cast<uint64_t>(args.seed) * 0x100000001B3ull + static_cast<uint64_t>((it * micro + m) * dp_size + dp_rank);
  };
  // The last micro-batch's backward finalises each layer's gradients: reduce them as it goes.
  const std::function<void(int64_t)> layer_done =
      optimizer.overlapping() ? std::function<void(int64_t)>([&](int64_t l) { optimizer.layer_ready(l); })
                              : std::function<void(int64_t)>();
  if (run.pp) {
    PipelineStep step;
    step.pp = run.pp;
    step.micro_batches = micro;
    step.grad_scale = 1.0 / static_cast<double>(micro);
    step.batch = batch_of;
    step.rng = rng_of;
    step.last_layer_done = layer_done;
    step.losses = &losses;
    step.mtp_losses = mtp_losses;
    if (run.vstages == 1) {
      run_pipeline_1f1b(run.model(), step);
    } else if (micro % run.stages == 0) {
      run_pipeline_interleaved(run.chunks, step);
    } else {
      run_pipeline_virtual(run.chunks, step);
    }
  } else if (args.overlap_moe_ep_comm) {  // micro-batch pairs interleaved layer by layer
    MC_CHECK(!hooks && !mtp_losses, "--overlap-moe-expert-parallel-comm: no CUDA graph or MTP (refused at the flags)");
    EpOverlapStep step;
    step.micro_batches = micro;
    step.grad_scale = 1.0 / static_cast<double>(micro);
    step.delay_wgrad = args.delay_wgrad_compute;
    step.batch = batch_of;
    step.rng = rng_of;
    step.last_layer_done = layer_done;
    step.losses = &losses;
    run_ep_overlap_schedule(run.model(), step);
  } else {
    GPTModel& model = run.model();
    for (int64_t m = 0; m < micro; ++m) {
      const Batch b = batch_of(m);
      GPTModel::Ctx ctx;
      ctx.fused_head_scale = 1.0 / static_cast<double>(micro);  // the output layer's backward runs in the forward
      const Tensor loss_sum = model.forward_loss_sum(b.tokens, b.labels, true, rng_of(m), with_checked_batch(ctx, b));
      add_micro_batch_losses(losses, mtp_losses, loss_sum, ctx);  // after the forward has set the counts
      model.backward(1.0 / static_cast<double>(micro), ctx, m == micro - 1 ? layer_done : std::function<void(int64_t)>());
    }
  }
}

// sums[1], sums[2] += each layer's aux and z loss per micro-batch, in layer order.
void add_balancing_losses(const std::vector<MoeStepStats>& layer_stats, int64_t micro, std::vector<double>& sums) {
  for (const MoeStepStats& s : layer_stats) {
    sums[1] += s.aux_loss / static_cast<double>(micro);
    sums[2] += s.z_loss / static_cast<double>(micro);
  }
}

// reduce_moe_statistics on the device: each layer's packed statistics reduced there, its end of
// step (expert bias) applied there, and a read of them started (pending.moe).
void moe_statistics_on_device(const std::vector<MoeLayer*>& moe_layers, comm::Communicator* token_group,
                              comm::Communicator* dp, std::optional<TimedRegion>& phase, Device dev,
                              PendingStepValues& pending, StepGraphHooks* hooks) {
  phase.emplace("moe-statistics", 1, dev);
  std::vector<Tensor> packed;
  for (MoeLayer* l : moe_layers) packed.push_back(l->pack_step_stats(token_group, dp, dev));
  phase.emplace("moe-finish-step", 1, dev);
  pending.moe = std::vector<PendingRead>(moe_layers.size());
  for (size_t l = 0; l < moe_layers.size(); ++l) {
    pending.moe_micro_batches.push_back(moe_layers[l]->step_micro_batches());
    moe_layers[l]->finish_step_on_device(packed[l], dp);
    if (hooks) {  // read after the graph's launch
      hooks->outputs.moe.push_back(packed[l]);
      hooks->outputs.moe_micro_batches.push_back(pending.moe_micro_batches.back());
    } else {
      pending.moe[l].start(packed[l]);
    }
  }
}

}  // namespace

std::vector<MoeStepStats> reduce_moe_statistics(const std::vector<MoeLayer*>& moe_layers,
                                                comm::Communicator* token_group, comm::Communicator* dp,
                                                std::optional<TimedRegion>& phase, Device dev) {
  phase.emplace("moe-statistics", 1, dev);
  for (MoeLayer* l : moe_layers) reduce_moe_step_stats(l->mutable_stats(), token_group, dp);
  phase.emplace("moe-finish-step", 1, dev);
  std::vector<MoeStepStats> layer_stats;
  for (MoeLayer* l : moe_layers) layer_stats.push_back(l->finish_step());
  return layer_stats;
}

StepResult train_step(TrainingRun& run, int64_t it, StepGraphHooks* hooks) {
  const TrainArgs& args = run.args;
  const Device dev = run.dev;
  const int64_t micro = run.micro;
  const bool has_head = run.has_head;
  comm::Communicator* dp = run.dp;
  Optimizer& optimizer = *run.optimizer;
  TrainingState& state = run.state;
  const DType loss_dtype = run.compute == DType::F64 ? DType::F64 : DType::F32;
  LossAccumulator losses(micro, dev, loss_dtype);
  std::vector<LossAccumulator> mtp_losses;  // each MTP depth's, on the stage with the head
  if (has_head)
    for (int64_t k = 0; k < run.cfg.mtp_num_layers; ++k) mtp_losses.emplace_back(micro, dev, loss_dtype);
  std::optional<TimedRegion> phase(std::in_place, "forward-backward", 1, dev);  // --timing-log-level
  // Memory accounting: the model names its activations; what the step allocates outside the
  // modules is workspace, the gradient reduction's buffers communication.
  std::optional<MemoryCategoryScope> memory(std::in_place, MemoryCategory::kWorkspace);
  if (run.fp8) run.fp8->set_recording(true);  // FP8 delayed scaling records the training passes' amaxes
  MC_CHECK(!hooks || (!run.pp && mtp_losses.empty()), "train_step: a CUDA graph's step has no pipeline stages or MTP");
  forward_backward(run, it, losses, has_head && !mtp_losses.empty() ? &mtp_losses : nullptr, hooks);
  if (run.fp8) {
    run.fp8->set_recording(false);
    run.fp8->finish_step(run.groups->tp(), run.groups->dp_cp());
  }
  // With pipeline stages the MoE layers' statistics are read on the host this step: they start for
  // the host now, so reading them below waits once at most (not once per layer).
  if (run.pp)
    for (MoeLayer* l : run.moe_layers) l->prefetch_stats();
  phase.emplace("grads-reduce", 1, dev);
  memory.emplace(MemoryCategory::kCommunication);
  optimizer.reduce_gradients();
  memory.emplace(MemoryCategory::kWorkspace);
  // The step's losses, averaged over DP on the device, go to the host behind the step's work
  // (no wait of their own); the lm loss also travels in the step's decision report.
  if (dp && has_head) dp->all_reduce(losses.value(), comm::ReduceOp::Avg);
  PendingRead loss_read;
  if (has_head && run.pp) loss_read.start(losses.value());
  std::vector<PendingRead> mtp_reads(mtp_losses.size());
  for (size_t k = 0; k < mtp_losses.size(); ++k) {
    if (dp) dp->all_reduce(mtp_losses[k].value(), comm::ReduceOp::Avg);
    mtp_reads[k].start(mtp_losses[k].value());
  }
  phase.emplace("grad-norm", 1, dev);
  const Tensor grad_sq_parts = optimizer.grad_norm_sq_parts();  // on the device
  StepResult r;
  r.iteration = it;
  auto pending = std::make_unique<PendingStepValues>();
  if (run.pp) {
    r.layer_stats = reduce_moe_statistics(run.moe_layers, run.groups->token_group(), dp, phase, dev);
  } else {  // on the device, read with the step's other values (resolve_step)
    moe_statistics_on_device(run.moe_layers, run.groups->token_group(), dp, phase, dev, *pending, hooks);
  }
  phase.emplace("loss-and-checks", 1, dev);
  std::vector<double> sums = {0.0, 0.0, 0.0, static_cast<double>(run.moe_layers.size())};
  add_balancing_losses(r.layer_stats, micro, sums);
  Tensor decided_loss = has_head ? losses.value() : Tensor();
  if (run.pp) {
    // The loss lives on the last stage, MoE layers on every stage: sums over the pipeline give
    // every rank the same values (the skip decision must agree everywhere). Read here (a wait).
    sums[0] = has_head ? loss_read.get()[0] : 0.0;
    for (int64_t k = 0; k < run.cfg.mtp_num_layers; ++k)
      sums.push_back(has_head ? mtp_reads[static_cast<size_t>(k)].get()[0] : 0.0);
    sum_over_ranks(run.pp, sums);
    decided_loss = Tensor::from_vector(std::vector<double>{sums[0]}, {1}).to(dev);
    r.mtp_losses.assign(sums.begin() + 4, sums.end());
  } else {
    pending->mtp = std::move(mtp_reads);
  }
  state.consumed_samples += args.global_batch_size;
  state.iteration = it;
  phase.emplace("optimizer", 1, dev);
  // Clipping and the NaN/Inf skip decided on the device (step_decisions.h): no host wait.
  if (hooks) {  // the candidates are in the fixed table (prepared before the launch)
    run.decisions.decide_on_device(args, grad_sq_parts, decided_loss);
    hooks->outputs.report = run.decisions.report();
  } else {
    run.decisions.decide(args, state, it, grad_sq_parts, decided_loss, dev);
    pending->report.start(run.decisions.report());
  }
  const AdamHyper hyper{args.adam_beta1, args.adam_beta2, args.adam_eps, args.weight_decay};
  optimizer.step(hyper, run.decisions.device_step());
  phase.reset();
  r.aux = sums[3] > 0 ? sums[1] / sums[3] : 0.0;
  r.z = sums[3] > 0 ? sums[2] / sums[3] : 0.0;
  r.pending = std::move(pending);
  return r;
}

std::unique_ptr<PendingStepValues> start_step_reads(const StepGraphHooks::Outputs& outputs) {
  auto pending = std::make_unique<PendingStepValues>();
  pending->mtp = std::vector<PendingRead>(outputs.mtp.size());
  for (size_t k = 0; k < outputs.mtp.size(); ++k) pending->mtp[k].start(outputs.mtp[k]);
  pending->moe = std::vector<PendingRead>(outputs.moe.size());
  for (size_t l = 0; l < outputs.moe.size(); ++l) pending->moe[l].start(outputs.moe[l]);
  pending->moe_micro_batches = outputs.moe_micro_batches;
  pending->report.start(outputs.report);
  return pending;
}

void resolve_step(TrainingRun& run, StepResult& r) {
  if (!r.pending) return;
  const std::vector<double> report = r.pending->report.get();
  r.lm_loss = report[0];
  r.grad_sq = report[1];
  r.grad_norm = std::sqrt(r.grad_sq);
  r.skipped = report[2] != 0.0;
  if (!r.pending->mtp.empty()) {
    r.mtp_losses.clear();
    for (PendingRead& m : r.pending->mtp) r.mtp_losses.push_back(m.get()[0]);
  }
  if (!r.pending->moe.empty()) {  // the MoE layers' statistics, then the step's balancing losses
    for (size_t l = 0; l < r.pending->moe.size(); ++l)
      r.layer_stats.push_back(
          run.moe_layers[l]->unpack_step_stats(r.pending->moe[l].get(), r.pending->moe_micro_batches[l]));
    std::vector<double> sums = {0.0, 0.0, 0.0, static_cast<double>(r.layer_stats.size())};
    add_balancing_losses(r.layer_stats, run.micro, sums);
    r.aux = sums[3] > 0 ? sums[1] / sums[3] : 0.0;
    r.z = sums[3] > 0 ? sums[2] / sums[3] : 0.0;
  }
  r.pending.reset();
  if (!r.skipped) return;
  if (run.logger)
    std::printf("iteration %lld: %s in the %s; step skipped\n", static_cast<long long>(r.iteration),
                std::isnan(r.lm_loss) || std::isnan(r.grad_sq) ? "NaN" : "Inf",
                std::isfinite(r.lm_loss) ? "gradients" : "loss");
  run.state.skipped_iterations++;
  run.state.nan_iterations++;
}

}  // namespace moecore
