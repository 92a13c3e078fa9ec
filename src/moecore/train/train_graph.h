// CUDA graphs of the whole training step: --cuda-graph-impl local --cuda-graph-scope full_iteration
// (one GPU). A step of a small model is hundreds of launches whose host cost can exceed the GPU's
// time for them; one graph launch replaces them.
//
// TrainStepGraph runs the training loop's steps on a stream of its own, current for the whole loop
// (steps, evaluation, checkpoints; the trainer makes it current). The first
// --cuda-graph-warmup-steps steps run eagerly (lazy initialisation: cuBLASLt workspaces, kernel
// attributes, the AdamW moments, the allocator's blocks of every shape); the next step that may run
// as a graph is captured with cudaStreamBeginCapture in the global mode -- any call that would wait
// for the GPU, in any thread, fails the capture, and the run stops naming the reason -- then
// launched, and every later such step replays it.
//
// What stays fixed across replays (every pointer a kernel reads and every host value it takes):
// - the micro-batches: the host reads and checks them as before and copies them through pinned
//   staging into fixed device buffers, enqueued on the stream before the launch;
// - the learning rate and the AdamW step: StepDecisions::prepare writes the candidate table into a
//   fixed device buffer before the launch (--log-interval + 1 rows);
// - memory: the capture allocates from a private pool of the CUDA allocator (core/allocator.h), so
//   the graph's blocks serve nothing else while it exists;
// - each micro-batch's labelled-token count (a scale the loss kernels take): checked per step.
// The values the host reads later (the step's loss, gradient norm and skip, the MoE statistics)
// are fixed device tensors of the graph; their reads start after each launch.
//
// The rule for eager steps (docs/usage.md): the warm-up steps; log steps (the metrics' reads);
// steps whose micro-batches' labelled-token counts differ from the captured step's (a masked
// label changes a kernel argument); steps with more unresolved skip decisions than the table
// holds. Evaluation and checkpoint saves are not steps: they run eagerly between steps, on the
// same stream. Eager and replayed steps run the same kernels in the same order on the same data:
// the same values bit for bit (tests/gpu/test_gpu_train_graph.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/train/train_setup.h"
#include "moecore/train/train_step.h"

namespace moecore {

class TrainStepGraph {
 public:
  // Refuses by name what the graph cannot do (beyond the flags' checks: expert GEMMs that read
  // their row counts on the host). Creates the stream; make it current before the first step.
  explicit TrainStepGraph(TrainingRun& run);
  ~TrainStepGraph();
  TrainStepGraph(const TrainStepGraph&) = delete;
  TrainStepGraph& operator=(const TrainStepGraph&) = delete;

  Stream stream() const { return stream_; }
  // Step `it` as train_step: eagerly when `eager` (a log step) or the rule above says so, else by
  // capturing (the first time) or replaying the graph.
  StepResult step(int64_t it, bool eager);
  bool last_step_replayed() const { return last_replayed_; }
  int64_t replayed_steps() const { return replayed_; }
  int64_t captured_at() const { return captured_at_; }  // the captured iteration (0: none yet)
  // One line for the log: the capture's iteration, the graph's memory, the replayed steps.
  std::string summary() const;

 private:
  bool fill_fixed_batches(int64_t it);  // false: the labelled counts differ from the captured ones
  StepResult capture(int64_t it);
  StepResult replay(int64_t it);

  TrainingRun& run_;
  Stream stream_;
  int pool_ = 0;                         // the allocator's private pool of this graph
  int64_t table_rows_ = 0;               // the fixed candidate table's rows
  int64_t steps_ = 0, replayed_ = 0, captured_at_ = 0;
  bool last_replayed_ = false;
  std::vector<Batch> fixed_;             // each micro-batch's fixed device buffers
  std::vector<int64_t> captured_labels_; // each micro-batch's labelled tokens in the captured step
  StepGraphHooks hooks_;                 // the fixed batches; the captured step's outputs
  struct Exec;                           // the captured graph (CUDA builds)
  std::unique_ptr<Exec> exec_;
};

}  // namespace moecore
