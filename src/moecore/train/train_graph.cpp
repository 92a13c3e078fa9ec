#include "moecore/train/train_graph.h"

#include <atomic>
#include <cstdio>

#include "moecore/core/allocator.h"
#include "moecore/core/allocator_pools.h"
#include "moecore/core/memory_categories.h"
#include "moecore/ops/grouped_gemm.h"

#if MOECORE_WITH_CUDA
#include "moecore/core/cuda_check.h"
#endif

namespace moecore {

namespace {
std::atomic<int> g_next_pool{1};
}  // namespace

struct TrainStepGraph::Exec {
#if MOECORE_WITH_CUDA
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
#endif
  bool ready() const {
#if MOECORE_WITH_CUDA
    return exec != nullptr;
#else
    return false;
#endif
  }
};

TrainStepGraph::TrainStepGraph(TrainingRun& run) : run_(run), exec_(std::make_unique<Exec>()) {
  const char* flag = "--cuda-graph-impl local: ";
  MC_CHECK(run.dev.is_cuda(), flag, "CUDA graphs need a GPU, and this run is on ", run.dev.str());
  MC_CHECK(!run.pp && run.args.world == 1 && run.cfg.mtp_num_layers == 0 && !run.fp8, flag,
           "the whole-step graph runs on one GPU without pipeline stages, MTP or FP8");
  // A dropless MoE layer sizes its expert GEMMs on the device only where the Hopper grouped GEMM
  // takes the weights (ops/grouped_gemm.h); elsewhere it reads the counts on the host each step.
  for (const auto& p : run.store->all())
    if ((p->name.find("experts.linear_fc1.weight") != std::string::npos ||
         p->name.find("experts.linear_fc2.weight") != std::string::npos) &&
        !ops::grouped_gemm_device_rows(p->weight))
      MC_FAIL(flag, "the expert GEMMs of ", p->name, " read their per-expert row counts on the host, which a graph "
              "cannot capture (device-side counts need bf16 experts on a Hopper GPU, sizes the Hopper grouped GEMM "
              "takes); use --bf16 on such a GPU or drop the flag");
  table_rows_ = run.args.log_interval + 1;  // a log step resolves every decided step
  pool_ = g_next_pool++;
  stream_ = Stream::create(run.dev);
  // The setup's work ran on the default stream, which a non-blocking stream does not wait for.
  synchronize(run.dev);
  fixed_.resize(static_cast<size_t>(run.micro));
  hooks_.batch = [this](int64_t m) { return fixed_[static_cast<size_t>(m)]; };
}

TrainStepGraph::~TrainStepGraph() {
#if MOECORE_WITH_CUDA
  try {
    stream_.synchronize();
  } catch (const std::exception&) {  // a destructor must not throw; the error surfaced at the step
  }
  if (exec_->exec) cudaGraphExecDestroy(exec_->exec);
  if (exec_->graph) cudaGraphDestroy(exec_->graph);
  hooks_ = StepGraphHooks();
  fixed_.clear();
  try {
    release_private_pool(cuda_allocator(run_.dev.index), pool_);
  } catch (const std::exception&) {
  }
  // The stream stays: the allocator's cached blocks keep its handle as their key.
#endif
}

std::string TrainStepGraph::summary() const {
  if (captured_at_ == 0) return "cuda graph: not captured (no step after the warm-up could run as a graph)";
  char buf[200];
  std::snprintf(buf, sizeof buf, "cuda graph: captured at iteration %lld (%.1f MiB of memory of its own); %lld steps replayed it",
                static_cast<long long>(captured_at_),
                static_cast<double>(private_pool_bytes(cuda_allocator(run_.dev.index), pool_)) / (1024.0 * 1024.0),
                static_cast<long long>(replayed_));
  return buf;
}

bool TrainStepGraph::fill_fixed_batches(int64_t) {
  const TrainArgs& args = run_.args;
  const MemoryCategoryScope module(ActivationModule::kBatch);
  std::vector<int64_t> labels;
  for (int64_t m = 0; m < run_.micro; ++m) {
    const Batch host = run_.data.train->batch(
        run_.state.consumed_samples + (m * run_.dp_size + run_.dp_rank) * args.micro_batch_size, args.micro_batch_size,
        Device::cpu());
    Batch& fixed = fixed_[static_cast<size_t>(m)];
    if (!fixed.tokens.defined()) {
      fixed.tokens = Tensor::empty(host.tokens.shape(), host.tokens.dtype(), run_.dev);
      fixed.labels = Tensor::empty(host.labels.shape(), host.labels.dtype(), run_.dev);
    }
    MC_CHECK(fixed.tokens.shape() == host.tokens.shape() && fixed.labels.shape() == host.labels.shape(),
             "--cuda-graph-impl local: micro-batch ", m, " of the step has the shape ", host.tokens.describe(),
             " where the graph's buffers have ", fixed.tokens.describe());
    labels.push_back(run_.checked_upload_into(host, fixed));
  }
  return captured_labels_.empty() || labels == captured_labels_;
}

StepResult TrainStepGraph::step(int64_t it, bool eager) {
  last_replayed_ = false;
  ++steps_;
  // The rule (train_graph.h): warm-up, log steps and too many unresolved decisions run eagerly.
  if (eager || steps_ <= run_.args.cuda_graph_warmup_steps || run_.decisions.unresolved() + 1 > table_rows_)
    return train_step(run_, it);
  if (!fill_fixed_batches(it)) return train_step(run_, it);  // other labelled counts: eagerly
  return exec_->ready() ? replay(it) : capture(it);
}

StepResult TrainStepGraph::capture(int64_t it) {
#if MOECORE_WITH_CUDA
  std::vector<int64_t> labels;
  for (const Batch& b : fixed_) labels.push_back(b.num_labels);
  run_.decisions.prepare(run_.args, run_.state, it, run_.dev, table_rows_);  // the fixed table, before the capture
  CachingAllocator& alloc = cuda_allocator(run_.dev.index);
  auto stream = static_cast<cudaStream_t>(stream_.handle());
  hooks_.outputs = StepGraphHooks::Outputs();
  std::string why;
  StepResult r;
  begin_private_pool(alloc, pool_);
  const cudaError_t begin = cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
  if (begin != cudaSuccess) {
    end_private_pool(alloc);
    MC_FAIL("--cuda-graph-impl local: cudaStreamBeginCapture: ", cudaGetErrorString(begin));
  }
  try {
    r = train_step(run_, it, &hooks_);
  } catch (const std::exception& e) {
    why = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  end_private_pool(alloc);
  if (why.empty() && end != cudaSuccess) why = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(end);
  if (why.empty()) {
    const cudaError_t inst = cudaGraphInstantiate(&exec_->exec, graph, 0);
    if (inst != cudaSuccess) {
      exec_->exec = nullptr;
      why = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(inst);
    }
  }
  if (!why.empty()) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();  // the refused call's error
    MC_FAIL("--cuda-graph-impl local: capturing training step ", it, " into a CUDA graph failed: ", why,
            " (a call in the step waits for the GPU or is not allowed in a graph); run without --cuda-graph-impl");
  }
  exec_->graph = graph;
  captured_at_ = it;
  captured_labels_ = labels;
  MC_CUDA_CHECK(cudaGraphLaunch(exec_->exec, stream));  // the capture ran nothing: this step's work
  r.pending = start_step_reads(hooks_.outputs);
  last_replayed_ = true;
  return r;
#else
  (void)it;
  MC_FAIL("--cuda-graph-impl local: this build has no CUDA");
#endif
}

StepResult TrainStepGraph::replay(int64_t it) {
#if MOECORE_WITH_CUDA
  // The host's part of train_step: the decision table, the counters (train_step's order).
  run_.decisions.prepare(run_.args, run_.state, it, run_.dev, table_rows_);
  run_.state.consumed_samples += run_.args.global_batch_size;
  run_.state.iteration = it;
  MC_CUDA_CHECK(cudaGraphLaunch(exec_->exec, static_cast<cudaStream_t>(stream_.handle())));
  StepResult r;
  r.iteration = it;
  r.pending = start_step_reads(hooks_.outputs);
  ++replayed_;
  last_replayed_ = true;
  return r;
#else
  (void)it;
  MC_FAIL("--cuda-graph-impl local: this build has no CUDA");
#endif
}

}  // namespace moecore
