// --cuda-graph-impl local --cuda-graph-scope full_iteration (train/train_graph.h): the same run
// eagerly and with the whole step captured (global capture mode: any host wait in the step fails
// the capture and the test) and replayed gives every step's loss and gradient norm and the final
// model and optimizer state (the checkpoint's tensors) bit for bit; the replayed steps wait for the
// GPU zero times. Dense and MoE (dropless, device-side expert offsets: bf16 on Hopper), 10 steps,
// log interval 5: steps 1-3 warm up, 4 is captured, 5 and 10 are log steps (eager), 6-9 replay.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <optional>

#include "moecore/ops/grouped_gemm.h"
#include "moecore/train/train_graph.h"
#include "moecore/train/train_setup.h"
#include "moecore/train/train_step.h"
#include "train_command.h"  // parse_train_args (apps/)
#include "op_harness.h"

using namespace moecore;

namespace {

struct RunOutcome {
  std::vector<double> losses, grad_norms, aux;
  std::vector<NamedTensor> state;  // the checkpoint's tensors
  int64_t replayed = 0, captured_at = 0, skipped = 0;
};

TrainArgs args_of(std::vector<std::string> argv, bool graph) {
  if (graph)
    argv.insert(argv.end(), {"--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"});
  bool help = false;
  std::string text;
  return parse_train_args(argv, &help, &text);
}

// The trainer's loop (trainer.cpp) without its metrics: log steps synchronise and resolve every
// step in order (TrainMetrics::resolve_steps).
RunOutcome train(const TrainArgs& args, bool* skip_test) {
  TrainingRun run(args);
  for (const auto& p : run.store->all())
    if (p->name.find("experts.linear_fc1.weight") != std::string::npos && !ops::grouped_gemm_device_rows(p->weight)) {
      *skip_test = true;
      return {};
    }
  std::unique_ptr<TrainStepGraph> graph;
  if (args.cuda_graph_full_iteration()) graph = std::make_unique<TrainStepGraph>(run);
  std::optional<StreamGuard> guard;
  if (graph) guard.emplace(graph->stream());
  RunOutcome out;
  std::vector<StepResult> unresolved;
  for (int64_t it = 1; it <= args.train_iters; ++it) {
    const bool log_step = it % args.log_interval == 0 || it == args.train_iters;
    const uint64_t before = host_synchronizations();
    StepResult r = graph ? graph->step(it, log_step) : train_step(run, it);
    if (graph && graph->last_step_replayed() && graph->captured_at() != it)
      EXPECT_EQ(host_synchronizations() - before, 0u) << "replayed step " << it << " waited for the GPU";
    if (graph) EXPECT_EQ(graph->last_step_replayed(), it >= 4 && !log_step) << "step " << it;
    unresolved.push_back(std::move(r));
    if (!log_step) continue;
    synchronize(run.dev);
    for (StepResult& s : unresolved) {
      resolve_step(run, s);
      out.losses.push_back(s.lm_loss);
      out.grad_norms.push_back(s.grad_norm);
      out.aux.push_back(s.aux);
    }
    unresolved.clear();
    run.decisions.resolved();
  }
  synchronize(run.dev);
  out.state = run.optimizer->full_state();
  if (graph) {
    out.replayed = graph->replayed_steps();
    out.captured_at = graph->captured_at();
  }
  out.skipped = run.state.skipped_iterations;
  return out;
}

void expect_graph_equals_eager(const std::vector<std::string>& argv) {
  bool skip = false;
  const RunOutcome eager = train(args_of(argv, false), &skip);
  if (skip) GTEST_SKIP() << "off Hopper the MoE layer reads its expert counts on the host: no graph";
  const RunOutcome graph = train(args_of(argv, true), &skip);
  EXPECT_EQ(graph.captured_at, 4);
  EXPECT_EQ(graph.replayed, 4) << "steps 6-9 replay the graph";
  EXPECT_EQ(eager.skipped, 0);
  ASSERT_EQ(eager.losses.size(), 10u);
  ASSERT_EQ(graph.losses.size(), 10u);
  for (size_t i = 0; i < eager.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&eager.losses[i], &graph.losses[i], sizeof(double)), 0)
        << "step " << i + 1 << " loss " << eager.losses[i] << " vs " << graph.losses[i];
    EXPECT_EQ(std::memcmp(&eager.grad_norms[i], &graph.grad_norms[i], sizeof(double)), 0)
        << "step " << i + 1 << " grad norm " << eager.grad_norms[i] << " vs " << graph.grad_norms[i];
    EXPECT_EQ(std::memcmp(&eager.aux[i], &graph.aux[i], sizeof(double)), 0) << "step " << i + 1 << " aux loss";
  }
  EXPECT_LT(eager.losses.back(), eager.losses.front()) << "the run learns";
  ASSERT_EQ(eager.state.size(), graph.state.size());
  for (size_t i = 0; i < eager.state.size(); ++i) {
    const Tensor& a = eager.state[i].tensor;
    const Tensor& b = graph.state[i].tensor;
    ASSERT_EQ(eager.state[i].name, graph.state[i].name);
    ASSERT_EQ(a.nbytes(), b.nbytes()) << eager.state[i].name;
    EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0) << eager.state[i].name << " differs";
  }
}

std::vector<std::string> tiny(std::vector<std::string> extra) {
  std::vector<std::string> argv = {"--config", MOECORE_SOURCE_DIR "/configs/tiny.yaml", "--device", "cuda", "--bf16",
                                   "--num-attention-heads", "2", "--train-iters", "10", "--log-interval", "5",
                                   "--eval-interval", "0", "--lr-warmup-iters", "2", "--clip-grad", "0.5"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

}  // namespace

TEST(GpuTrainGraph, DenseReplayedStepsEqualEagerBitForBit) {
  MC_REQUIRE_CUDA();
  expect_graph_equals_eager(tiny({"--num-experts", "0", "--ffn-hidden-size", "128"}));
}

// The MoE shapes of GpuHostWaits.SteadyStateTrainingStep* (the Hopper grouped GEMM's device offsets).
TEST(GpuTrainGraph, MoeReplayedStepsEqualEagerBitForBit) {
  MC_REQUIRE_CUDA();
  expect_graph_equals_eager(tiny({"--hidden-size", "256", "--ffn-hidden-size", "512", "--num-experts", "16",
                                  "--moe-router-topk", "4", "--moe-ffn-hidden-size", "128", "--moe-z-loss-coeff",
                                  "1e-3"}));
}

TEST(GpuTrainGraph, MoeWithExpertBiasReplayedStepsEqualEagerBitForBit) {
  MC_REQUIRE_CUDA();
  expect_graph_equals_eager(tiny({"--hidden-size", "256", "--ffn-hidden-size", "512", "--num-experts", "16",
                                  "--moe-router-topk", "4", "--moe-ffn-hidden-size", "128",
                                  "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"}));
}

// --moe-router-force-load-balancing: the round-robin logits are built in the warm-up steps and
// kept on the device, so the captured step reads them without a host upload (an upload from
// pageable memory inside a capture would fail it).
TEST(GpuTrainGraph, MoeForcedBalanceReplayedStepsEqualEagerBitForBit) {
  MC_REQUIRE_CUDA();
  expect_graph_equals_eager(tiny({"--hidden-size", "256", "--ffn-hidden-size", "512", "--num-experts", "16",
                                  "--moe-router-topk", "4", "--moe-ffn-hidden-size", "128",
                                  "--moe-router-force-load-balancing"}));
}
