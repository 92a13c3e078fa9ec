#include "moecore/train/trainer.h"

#include <chrono>
#include <cstdint>
#include <iostream>
#include <memory>
#include <optional>

#include "moecore/core/allocator.h"
#include "moecore/core/device.h"
#include "moecore/core/memory_categories.h"
#include "moecore/core/progress.h"
#include "moecore/core/step_timers.h"
#include "moecore/moe/dispatch_load.h"
#include "moecore/train/checkpoint_transfer.h"
#include "moecore/train/evaluate.h"
#include "moecore/train/metrics.h"
#include "moecore/train/save_dir_guard.h"
#include "moecore/train/train_setup.h"
#include "moecore/train/train_graph.h"
#include "moecore/train/train_step.h"

namespace moecore {

int64_t active_matmul_params(const ModelConfig& c) {
  const int64_t h = c.hidden_size, d = c.head_dim();
  int64_t attn = h * c.num_attention_heads * d * 2 + h * c.kv_heads() * d * 2;
  if (c.mla.enabled) {  // the down and up projections and linear_proj (model/mla_attention.h)
    const MlaConfig& m = c.mla;
    const int64_t n = c.num_attention_heads, q = n * m.q_head_dim();
    attn = (m.q_lora_rank > 0 ? h * m.q_lora_rank + m.q_lora_rank * q : h * q) +
           h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim) +
           n * m.v_head_dim * h;
  }
  int64_t total = c.vocab_size * h;  // output head
  auto layer = [&](int64_t i) {  // a layer with the MLP or MoE of decoder layer i
    total += attn;
    if (c.is_moe(i)) {
      const int64_t f = c.moe.ffn_hidden_size;
      total += c.moe.num_experts * h + c.moe.router.topk * h * f * (c.swiglu ? 3 : 2);
      if (c.moe.shared_expert_size > 0) total += h * c.moe.shared_expert_size * (c.swiglu ? 3 : 2);
    } else {
      total += h * c.ffn_hidden_size * (c.swiglu ? 3 : 2);
    }
  };
  for (int64_t i = 0; i < c.num_layers; ++i) layer(i);
  // Each MTP module (training): eh_proj [H, 2H], a layer like the last one, the output head again.
  for (int64_t k = 0; k < c.mtp_num_layers; ++k) {
    total += 2 * h * h + c.vocab_size * h;
    layer(c.num_layers - 1);
  }
  return total;
}

double model_flops_per_step(const ModelConfig& c, int64_t tokens) {
  // The attention products' width: hidden (q.k and p.v at heads x head dim); MLA's q.k at
  // heads x (qk + rope dim) and p.v at heads x v dim, averaged.
  const double width = c.mla.enabled ? 0.5 * static_cast<double>(c.num_attention_heads) *
                                           static_cast<double>(c.mla.q_head_dim() + c.mla.v_head_dim)
                                     : static_cast<double>(c.hidden_size);
  return 6.0 * static_cast<double>(active_matmul_params(c)) * static_cast<double>(tokens) +
         6.0 * static_cast<double>(c.num_layers + c.mtp_num_layers) * static_cast<double>(c.seq_length) * width *
             static_cast<double>(tokens);
}

namespace {
// Before any work: the --save lock and write probes of every output path, each naming its flag.
std::unique_ptr<SaveDirLock> guard_output_paths(const TrainArgs& args) {
  std::unique_ptr<SaveDirLock> lock;
  if (args.rank == 0 && !args.save.empty()) {  // rank 0 writes the checkpoints
    lock = std::make_unique<SaveDirLock>(args.save);
    probe_writable_dir(args.save, "--save");
  }
  if (args.logging_rank()) {  // the logging rank writes the metrics
    if (!args.metrics_file.empty()) probe_writable_file(args.metrics_file, "--metrics-file");
    if (!args.tensorboard_dir.empty()) probe_writable_dir(args.tensorboard_dir, "--tensorboard-dir");
  }
  return lock;
}
}  // namespace

int run_training(const TrainArgs& args) {
  if (args.memory_report) enable_memory_accounting();  // before anything is allocated
  const std::unique_ptr<SaveDirLock> save_lock = guard_output_paths(args);  // before any work
  TrainingRun run(args);  // communicators, model, optimizer, --load, data (train_setup.h)
  TrainMetrics metrics(args, run.logger);
  print_run_summary(run);
  run.state.args = args.flag_values;
  // The tokenizer travels with the checkpoints: its files in <save>/tokenizer/, recorded relative
  // to the save directory (checkpoint_tokenizer resolves it).
  if (!args.save.empty() && !args.tokenizer_model.empty()) {
    const std::string name = run.writer ? copy_tokenizer_files(args.tokenizer_model, args.save + "/tokenizer")
                                        : tokenizer_file_name(args.tokenizer_model);
    for (auto& [flag, value] : run.state.args)
      if (flag == "tokenizer-model") value = "tokenizer/" + name;
  }
  auto save = [&] { save_training_checkpoint(args, run.chunk_stages, run.state, *run.optimizer, *run.groups); };
  // --cuda-graph-impl local (train_graph.h): every step, evaluation and save on the graph's stream.
  std::unique_ptr<TrainStepGraph> graph;
  if (args.cuda_graph_full_iteration()) graph = std::make_unique<TrainStepGraph>(run);
  std::optional<StreamGuard> on_graph_stream;
  if (graph) on_graph_stream.emplace(graph->stream());

  set_timing_level(static_cast<int>(args.timing_log_level));
  // The host waits for the GPU at a log step only (and each step with --timing-log-level, whose
  // timers read their events): the interval's time is the wall time from its start to the wait
  // at its log step, less evaluations and checkpoints in it.
  using Clock = std::chrono::steady_clock;
  metrics.start_interval();
  auto ms_since = [](Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); };
  // Until the first log line, a progress line every --progress-interval seconds (a long
  // --log-interval, or slow steps, would leave the terminal silent): the host may run ahead of
  // the GPU by the steps the allocator and the queue allow, so its count can lead the GPU's.
  const int64_t first_it = run.state.iteration + 1;
  int64_t first_log = first_it;
  while (first_log < args.train_iters && !is_log_step(args, first_log)) ++first_log;
  ProgressLine before_log("moecore train: steps before the first log line", static_cast<double>(first_log - first_it + 1),
                          "steps", run.logger ? &std::cout : nullptr, args.progress_interval_s);
  for (int64_t it = first_it; it <= args.train_iters; ++it) {
    if (it <= first_log && it > first_it)
      before_log.update(static_cast<double>(it - first_it), "iteration " + std::to_string(it) + " of " + std::to_string(args.train_iters));
    const uint64_t syncs0 = host_synchronizations();
    if (run.dev.is_cuda()) cuda_allocator(run.dev.index).reset_peak();
    arm_dispatch_clocks(is_log_step(args, it));  // the EP collectives' events, read at the log step
    // With a CUDA graph, log steps run eagerly (their reads resolve the steps); the others replay it.
    StepResult result = graph ? graph->step(it, is_log_step(args, it)) : train_step(run, it);
    const bool log_now = metrics.end_step(run, it, std::move(result), syncs0);

    const bool evaluate_now =
        args.eval_interval > 0 && run.data.valid && (it % args.eval_interval == 0 || it == args.train_iters);
    const bool save_now = args.save_interval > 0 && it % args.save_interval == 0 && it != args.train_iters;
    if ((evaluate_now || save_now) && !log_now) {
      synchronize(run.dev);  // the step's own work counts as training time
      metrics.resolve_steps(run);  // the skip counts a checkpoint records
    }
    const auto excluded_start = Clock::now();
    if (evaluate_now) metrics.log_validation(it, evaluate(run));
    if (save_now) save();
    if (evaluate_now || save_now) {
      synchronize(run.dev);
      metrics.exclude_ms(ms_since(excluded_start));
    }
  }
  if (graph && run.logger) std::cout << graph->summary() << "\n";
  save();
  if (graph) synchronize(run.dev);  // the graph's stream's work done before the graph goes
  return 0;
}

}  // namespace moecore
