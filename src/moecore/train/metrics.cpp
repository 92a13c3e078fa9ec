#include "moecore/train/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moecore/core/allocator.h"
#include "moecore/core/step_timers.h"
#include "moecore/moe/dispatch_load.h"
#include "moecore/train/lr_schedule.h"
#include "moecore/train/memory_report.h"

namespace moecore {

namespace {

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  return buf;
}

AllocatorStats memory_stats(Device d) {
  return d.is_cuda() ? cuda_allocator(d.index).stats() : cpu_allocator().stats();
}

// --timing-log-level: one line per region, indented by nesting, milliseconds per iteration over
// the log interval (this rank's current stream) and the share of the step time.
void print_timers(const std::vector<RegionTime>& timers, int64_t steps, double step_ms) {
  if (timers.empty() || steps <= 0) return;
  std::printf("   timers (ms per iteration, this rank's GPU events; nested regions are part of their parent):\n");
  for (const RegionTime& r : timers) {
    const double ms = r.ms / static_cast<double>(steps);
    std::printf("   %*s%-*s %9.2f ms %5.1f%%  (%lld calls)\n", 2 * r.depth, "", 28 - 2 * r.depth, r.name.c_str(), ms,
                step_ms > 0 ? 100.0 * ms / step_ms : 0.0, static_cast<long long>(r.calls));
  }
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

// The values of a log step's line.
struct TrainMetrics::Interval {
  double interval_ms = 0;  // wall time of the interval's steps
  double params_norm = 0;
  double dispatch_ms = 0, dispatch_wait_ms = 0;  // MOECORE_COMM_TIMERS=1 only
  DispatchLoadReport load;  // the log step's EP load imbalance (moe/dispatch_load.h)
  DispatchVolume dispatch_volume;  // the last step's forward token dispatch (shown with MOECORE_COMM_TIMERS=1)
  std::vector<RegionTime> timers;
};

bool is_log_step(const TrainArgs& args, int64_t it) { return it % args.log_interval == 0 || it == args.train_iters; }

TrainMetrics::TrainMetrics(const TrainArgs& args, bool logger) : logger_(logger) {
  if (logger && !args.tensorboard_dir.empty()) tb_ = std::make_unique<TensorBoardWriter>(args.tensorboard_dir);
  if (logger && !args.metrics_file.empty()) {
    std::error_code ec;
    const auto parent = std::filesystem::path(args.metrics_file).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    metrics_.open(args.metrics_file, std::ios::app);
    MC_CHECK(metrics_.good(), "--metrics-file '", args.metrics_file, "': cannot open it for writing");
  }
}

TrainMetrics::~TrainMetrics() = default;

void TrainMetrics::start_interval() {
  interval_start_ = Clock::now();
  interval_excluded_ms_ = 0;
}

StepHealth step_health(const StepResult& step, bool have_previous, double previous_loss) {
  if (step.skipped) return StepHealth::kLearning;  // reported as a NaN/Inf step
  if (step.grad_sq == 0.0) return StepHealth::kZeroGradients;
  if (have_previous && step.lm_loss == previous_loss && step.grad_norm < 1e-8) return StepHealth::kConstantLoss;
  return StepHealth::kLearning;
}

void TrainMetrics::check_health(int64_t it, const StepResult& step, bool log_now) {
  if (step.skipped) return;  // reported as a NaN/Inf step
  // A step that cannot change the model (a saturated model, e.g. a huge --init-method-std):
  // reported at the first such step and then at each log step while it lasts.
  const StepHealth health = step_health(step, have_previous_loss_, previous_loss_);
  previous_loss_ = step.lm_loss;
  have_previous_loss_ = true;
  if (health == StepHealth::kLearning) {
    stalled_steps_ = 0;
    return;
  }
  ++stalled_steps_;
  if (!logger_ || (stalled_steps_ > 1 && !log_now)) return;
  if (health == StepHealth::kZeroGradients)
    std::printf("warning: iteration %lld: every gradient is zero (grad norm 0; %lld such step(s) in a row): the "
                "model does not learn; check --init-method-std, --lr and the data\n",
                static_cast<long long>(it), static_cast<long long>(stalled_steps_));
  else
    std::printf("warning: iteration %lld: the loss is exactly constant (%.6f) with grad norm %.3g (%lld such step(s) "
                "in a row): the model does not learn; check --init-method-std, --lr and the data\n",
                static_cast<long long>(it), step.lm_loss, step.grad_norm, static_cast<long long>(stalled_steps_));
}

void TrainMetrics::account_step(TrainingRun& run, StepResult& step) {
  resolve_step(run, step);  // its loss, gradient norm and skip (and the skip's count in run.state)
  check_health(step.iteration, step, is_log_step(run.args, step.iteration));
  if (step.skipped) {
    interval_skipped_++;
    interval_nan_++;
    return;
  }
  interval_loss_ += step.lm_loss;
  interval_aux_ += step.aux;
  interval_mtp_.resize(step.mtp_losses.size(), 0.0);
  for (size_t k = 0; k < step.mtp_losses.size(); ++k) interval_mtp_[k] += step.mtp_losses[k];
  interval_z_ += step.z;
  interval_loss_steps_++;
}

void TrainMetrics::resolve_steps(TrainingRun& run) {
  for (StepResult& s : unresolved_) account_step(run, s);
  if (!unresolved_.empty()) last_ = std::move(unresolved_.back());
  unresolved_.clear();
  run.decisions.resolved();  // every decided step is counted in run.state now
}

bool TrainMetrics::end_step(TrainingRun& run, int64_t it, StepResult step, uint64_t syncs0) {
  const TrainArgs& args = run.args;
  const Device dev = run.dev;
  unresolved_.push_back(std::move(step));  // until the host reads it (a log step; --timing-log-level: each step)
  const bool log_now = is_log_step(args, it);
  const bool timers_on = args.timing_log_level > 0;
  if (log_now || timers_on) synchronize(dev);
  Interval v;
  // Read the clock before the logging below (params-norm collective, printing): the interval's time is its steps'.
  v.interval_ms = log_now ? ms_since(interval_start_) - interval_excluded_ms_ : 0.0;
  if (timers_on) collect_region_times();  // after the synchronisation: reads finished events only
  if (log_now || timers_on) resolve_steps(run);  // after the synchronisation: their reads have arrived
  // Includes the log step's synchronisation just above; evaluation and checkpoint waits come
  // after this line and before the next step's syncs0, so they are not counted (as their time).
  interval_syncs_ += host_synchronizations() - syncs0;
  const DispatchCommTime dispatch_time = take_dispatch_comm_time();  // MOECORE_COMM_TIMERS=1 only
  v.dispatch_ms = dispatch_time.seconds * 1e3;
  v.dispatch_wait_ms = dispatch_time.wait_seconds * 1e3;
  v.dispatch_volume = take_dispatch_volume();
  interval_steps_++;

  v.params_norm = log_now ? std::sqrt(run.optimizer->params_norm_sq()) : 0.0;  // collective
  // The step's received rows and (armed at log steps) EP collective times; reduced over the EP
  // group at log steps only, after the synchronisation above (the events have completed).
  const DispatchLoadSample load = take_dispatch_load();
  arm_dispatch_clocks(false);  // an evaluation or checkpoint after this step records nothing
  if (log_now && run.groups) v.load = reduce_dispatch_load(load, run.groups->ep());  // collective
  if (log_now) v.timers = take_region_times();
  if (logger_ && log_now) {
    write_log_step(run, it, last_, v);
    interval_loss_ = interval_aux_ = interval_z_ = 0;
    interval_mtp_.assign(interval_mtp_.size(), 0.0);
    interval_steps_ = interval_skipped_ = interval_nan_ = interval_loss_steps_ = 0;
    interval_syncs_ = 0;
  }
  if (log_now && run.args.memory_report && !memory_reported_) write_memory_report(run, it);
  if (log_now) start_interval();  // the next interval starts here (the queue is empty: the params norm above read its result back)
  return log_now;
}

void TrainMetrics::write_log_step(TrainingRun& run, int64_t it, const StepResult& step, const Interval& v) {
  const TrainArgs& args = run.args;
  const ModelConfig& cfg = run.cfg;
  const Device dev = run.dev;
  const TrainingState& state = run.state;
  const bool moe = !run.moe_layers.empty();
  const std::vector<MoeStepStats>& layer_stats = step.layer_stats;
  const std::vector<int64_t>& moe_numbers = run.moe_numbers;
  const double micro = static_cast<double>(run.micro);
  const double grad_norm = step.grad_norm;
  const double avg_ms = v.interval_ms / static_cast<double>(interval_steps_);
  const double steps_in = static_cast<double>(interval_loss_steps_);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double avg_loss = interval_loss_steps_ > 0 ? interval_loss_ / steps_in : nan;
  const double avg_aux = interval_loss_steps_ > 0 ? interval_aux_ / steps_in : nan;
  const double avg_z = interval_loss_steps_ > 0 ? interval_z_ / steps_in : nan;
  std::vector<double> avg_mtp;  // "mtp_<k> loss", k = 1..D
  for (int64_t k = 0; k < cfg.mtp_num_layers; ++k)
    avg_mtp.push_back(interval_loss_steps_ > 0 && static_cast<size_t>(k) < interval_mtp_.size()
                          ? interval_mtp_[static_cast<size_t>(k)] / steps_in
                          : nan);
  const double logged_lr = learning_rate(args, it - state.skipped_iterations - state.optimizer_offset);  // the next step's, as Megatron logs
  const double tflops = run.flops_per_step / (avg_ms * 1e-3) / 1e12 / static_cast<double>(args.world);  // per GPU
  const double tokens_per_s = static_cast<double>(run.tokens_per_step) / (avg_ms * 1e-3);
  const AllocatorStats mem = memory_stats(dev);
  std::printf(" [%s] iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
              "throughput per GPU (TFLOP/s/GPU): %.1f | learning rate: %.6E | global batch size: %5lld | "
              "lm loss: %.6E |",
              timestamp().c_str(), static_cast<long long>(it), static_cast<long long>(args.train_iters),
              static_cast<long long>(state.consumed_samples), avg_ms, tflops, logged_lr,
              static_cast<long long>(args.global_batch_size), avg_loss);
  for (size_t k = 0; k < avg_mtp.size(); ++k) std::printf(" mtp_%zu loss: %.6E |", k + 1, avg_mtp[k]);
  if (moe) std::printf(" load_balancing_loss: %.6E | z_loss: %.6E |", avg_aux, avg_z);
  std::printf(" loss scale: 1.0 | grad norm: %.3f | params norm: %.3f | number of skipped iterations: %3lld | "
              "number of nan iterations: %3lld | tokens/s: %.0f |",
              grad_norm, v.params_norm, static_cast<long long>(interval_skipped_), static_cast<long long>(interval_nan_),
              tokens_per_s);
  if (dev.is_cuda()) std::printf(" MFU: %.1f%% |", 100.0 * tflops / 989.0);
  std::printf(" mem allocated/peak (GB): %.2f/%.2f |", mem.allocated_bytes / 1e9, mem.peak_allocated_bytes / 1e9);
  if (dispatch_timers_enabled())
    std::printf(" dispatch communication (ms, last step): %.1f (%.0f%% of the average step; waiting for the "
                "slowest rank: %.1f) |",
                v.dispatch_ms, 100.0 * v.dispatch_ms / avg_ms, v.dispatch_wait_ms);
  if (v.load.valid)
    std::printf(" EP received rows (last step) min/mean/max: %.0f/%.0f/%.0f (imbalance %.2f) |", v.load.rows_min,
                v.load.rows_mean, v.load.rows_max, v.load.imbalance);
  if (v.load.timed)
    std::printf(" EP dispatch collectives (ms, last step, mean over EP ranks): %.1f, waiting for the slowest rank: "
                "%.1f (max %.1f) |",
                v.load.comm_ms_mean, v.load.wait_ms_mean, v.load.wait_ms_max);
  if (dispatch_timers_enabled() && v.dispatch_volume.rows > 0)
    std::printf(" forward token dispatch (last step): %lld bytes for %lld rows |",
                static_cast<long long>(v.dispatch_volume.bytes), static_cast<long long>(v.dispatch_volume.rows));
  const Fp8ParamGather::Volume gathered = run.optimizer->param_gather_volume();  // distributed optimizer, bf16
  if (dispatch_timers_enabled() && gathered.fp8_elements + gathered.bf16_elements > 0)
    std::printf(" parameter all-gather (last step): %lld FP8 weight elements in %lld bytes, %lld bf16 elements in "
                "%lld bytes, %lld bytes of amaxes all-reduced |",
                static_cast<long long>(gathered.fp8_elements), static_cast<long long>(gathered.fp8_elements),
                static_cast<long long>(gathered.bf16_elements), static_cast<long long>(2 * gathered.bf16_elements),
                static_cast<long long>(gathered.amax_bytes));
  std::printf("\n");
  print_timers(v.timers, interval_steps_, avg_ms);
  if (cfg.moe.per_layer_logging) {
    for (size_t l = 0; l < layer_stats.size(); ++l) {
      std::printf("   layer %lld (MoE): load_balancing_loss %.6E z_loss %.6E tokens per expert [",
                  static_cast<long long>(moe_numbers[l]), layer_stats[l].aux_loss / micro, layer_stats[l].z_loss / micro);
      for (size_t e = 0; e < layer_stats[l].tokens_per_expert.size(); ++e)
        std::printf("%s%.0f", e ? " " : "", layer_stats[l].tokens_per_expert[e]);
      std::printf("]\n");
    }
  }
  std::fflush(stdout);
  nlohmann::json j = {{"iteration", it},        {"lm_loss", avg_loss},       {"learning_rate", logged_lr},
                      {"grad_norm", grad_norm}, {"params_norm", v.params_norm}, {"ms_per_iteration", avg_ms},
                      {"tflops_per_gpu", tflops}, {"tokens_per_s", tokens_per_s},
                      {"consumed_samples", state.consumed_samples},
                      {"skipped_iterations", state.skipped_iterations},
                      {"mem_allocated_bytes", mem.allocated_bytes},
                      {"mem_max_allocated_bytes", mem.peak_allocated_bytes},
                      {"mem_max_reserved_bytes", mem.peak_reserved_bytes},
                      {"host_syncs_per_iteration",
                       static_cast<double>(interval_syncs_) / static_cast<double>(interval_steps_)}};
  if (!v.timers.empty()) {
    nlohmann::json t = nlohmann::json::object();
    for (const RegionTime& r : v.timers) t[r.name] = r.ms / static_cast<double>(interval_steps_);
    j["timers_ms_per_iteration"] = t;
  }
  for (size_t k = 0; k < avg_mtp.size(); ++k) j["mtp_" + std::to_string(k + 1) + "_loss"] = avg_mtp[k];
  if (v.load.valid) {
    j["moe_ep_received_rows_min"] = v.load.rows_min;
    j["moe_ep_received_rows_mean"] = v.load.rows_mean;
    j["moe_ep_received_rows_max"] = v.load.rows_max;
    j["moe_ep_imbalance"] = v.load.imbalance;
  }
  if (v.load.timed) {
    j["moe_ep_dispatch_comm_ms"] = v.load.comm_ms_mean;
    j["moe_ep_dispatch_wait_ms"] = v.load.wait_ms_mean;
    j["moe_ep_dispatch_wait_max_ms"] = v.load.wait_ms_max;
  }
  if (moe) {
    j["load_balancing_loss"] = avg_aux;
    j["z_loss"] = avg_z;
    if (cfg.moe.per_layer_logging) {
      nlohmann::json per = nlohmann::json::array();
      for (const MoeStepStats& s : layer_stats) per.push_back(s.tokens_per_expert);
      j["tokens_per_expert"] = per;
    }
  }
  if (metrics_.is_open()) metrics_ << j.dump() << "\n" << std::flush;
  if (tb_) {
    tb_->add_scalar("learning-rate", logged_lr, it);
    tb_->add_scalar("batch-size", static_cast<double>(args.global_batch_size), it);
    tb_->add_scalar("lm loss", avg_loss, it);
    for (size_t k = 0; k < avg_mtp.size(); ++k) tb_->add_scalar("mtp_" + std::to_string(k + 1) + " loss", avg_mtp[k], it);
    tb_->add_scalar("grad-norm", grad_norm, it);
    tb_->add_scalar("iteration-time", avg_ms / 1000.0, it);
    tb_->add_scalar("throughput", tflops, it);
    tb_->add_scalar("mem-allocated-bytes", static_cast<double>(mem.allocated_bytes), it);
    tb_->add_scalar("mem-max-allocated-bytes", static_cast<double>(mem.peak_allocated_bytes), it);
    if (moe) {
      tb_->add_scalar("load_balancing_loss", avg_aux, it);
      tb_->add_scalar("z_loss", avg_z, it);
      if (cfg.moe.per_layer_logging)
        for (size_t l = 0; l < layer_stats.size(); ++l) {
          tb_->add_scalar("moe/load_balancing_loss_layer_" + std::to_string(moe_numbers[l]),
                          layer_stats[l].aux_loss / micro, it);
          tb_->add_scalar("moe/z_loss_layer_" + std::to_string(moe_numbers[l]), layer_stats[l].z_loss / micro, it);
        }
    }
    tb_->flush();
  }
}

void TrainMetrics::write_memory_report(TrainingRun& run, int64_t it) {
  memory_reported_ = true;
  const RankMemoryReport mine = local_memory_report(allocator_for(run.dev), run.args.rank);
  // An emulated rank reports itself only (the other ranks do not exist).
  const std::vector<RankMemoryReport> all = run.args.emulated() ? std::vector<RankMemoryReport>{mine}
                                            : gather_memory_reports(run.groups->world(), mine, run.args.world);
  if (!logger_) return;
  std::printf("%s", format_memory_report(all, it).c_str());
  if (run.args.emulated())
    std::printf("     (rank %lld of an emulated world of %lld: measured on this process, communication replaced by "
                "local stand-ins)\n",
                static_cast<long long>(run.args.rank), static_cast<long long>(run.args.world));
  std::fflush(stdout);
  if (metrics_.is_open()) metrics_ << memory_report_json(all, it).dump() << "\n" << std::flush;
}

void TrainMetrics::log_validation(int64_t it, double vloss) {
  if (logger_)
    std::printf(" validation loss at iteration %lld | lm loss value: %.6E | lm loss PPL: %.6E |\n",
                static_cast<long long>(it), vloss, std::exp(std::min(vloss, 700.0)));
  std::fflush(stdout);
  if (metrics_.is_open()) metrics_ << nlohmann::json({{"iteration", it}, {"valid_lm_loss", vloss}}).dump() << "\n";
  if (tb_) tb_->add_scalar("lm loss validation", vloss, it);
}

}  // namespace moecore
