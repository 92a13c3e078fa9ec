#include "moecore/train/decode_step.h"

#include <map>
#include <mutex>
#include <optional>

#include "moecore/ops/argmax.h"
#include "moecore/ops/common.h"
#include "moecore/ops/elementwise.h"

#if MOECORE_WITH_CUDA
#include "moecore/core/cuda_check.h"
#endif

namespace moecore {

namespace {

#if MOECORE_WITH_CUDA
// Each device's graph stream: created once for the process, held by one DecodeStep at a time
// (its cached blocks are the graph's memory).
struct GraphStream {
  Stream stream;
  bool held = false;
};
std::mutex g_streams_mutex;
std::map<int, GraphStream> g_streams;

// The device's graph stream, or a null one when another DecodeStep holds it.
Stream acquire_graph_stream(Device device) {
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  GraphStream& g = g_streams[device.index];
  if (g.held) return Stream(device, nullptr);
  if (!g.stream.handle()) g.stream = Stream::create(device);
  g.held = true;
  return g.stream;
}

void release_graph_stream(Device device) {
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  g_streams[device.index].held = false;
}
#endif

}  // namespace

struct DecodeStep::Graph {
  Stream stream;
  bool failed = false;  // the capture failed: eager steps on `stream`
#if MOECORE_WITH_CUDA
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
#endif
};

DecodeStep::DecodeStep(GPTModel& model, GPTModel::KvCache& cache, Device device, bool greedy, bool use_graph)
    : model_(model), cache_(cache), device_(device), greedy_(greedy), rows_(cache.rows),
      vocab_(model.config().vocab_size), status_("eager") {
#if MOECORE_WITH_CUDA
  if (use_graph && device.is_cuda() && !model.decode_graphable()) {
    status_ = "eager: Multi-Latent Attention's cached attention reads the positions on the host";
  } else if (use_graph && device.is_cuda()) {
    const Stream s = acquire_graph_stream(device);
    if (s.handle()) {
      graph_ = std::make_unique<Graph>();
      graph_->stream = s;
    } else {
      status_ = "eager: another decoding step holds this device's graph stream";
    }
  }
#else
  (void)use_graph;
#endif
  std::optional<StreamGuard> guard;
  if (graph_) guard.emplace(graph_->stream);
  inputs_ = Tensor::empty({2 * rows_}, DType::I32, device);  // one upload per step: tokens, then positions
  tokens_ = inputs_.slice(0, 0, rows_).view({rows_, 1});
  positions_ = inputs_.slice(0, rows_, 2 * rows_);
  logits_ = Tensor::empty({rows_, vocab_}, DType::F32, device);
  if (greedy_) ids_ = Tensor::empty({rows_}, DType::I32, device);
}

DecodeStep::~DecodeStep() {
#if MOECORE_WITH_CUDA
  if (!graph_) return;
  try {
    graph_->stream.synchronize();
  } catch (const std::exception&) {  // a destructor must not throw; the error surfaced at the step
  }
  if (graph_->exec) cudaGraphExecDestroy(graph_->exec);
  if (graph_->graph) cudaGraphDestroy(graph_->graph);
  inputs_ = tokens_ = positions_ = logits_ = ids_ = Tensor();  // back to the stream's cache
  release_graph_stream(device_);
#endif
}

bool DecodeStep::replaying() const {
#if MOECORE_WITH_CUDA
  return graph_ && graph_->exec;
#else
  return false;
#endif
}

Tensor DecodeStep::device_logits() const { return logits_; }

// The captured work: the model's step into the fixed buffers.
void DecodeStep::body() {
  const ops::EmbeddingIdsValidated ids_valid;  // sampled from the vocabulary; positions < the cache's length
  const Tensor logits = model_.decode_logits(tokens_, positions_, cache_);
  if (logits.dtype() == DType::F32) {
    logits_.copy_from(logits);
  } else {
    ops::cast(logits, logits_);
  }
  if (greedy_) ops::argmax_rows(logits_, ids_);
}

void DecodeStep::capture_and_replay() {
#if MOECORE_WITH_CUDA
  auto stream = static_cast<cudaStream_t>(graph_->stream.handle());
  std::string why;
  MC_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    body();
  } catch (const std::exception& e) {
    why = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  if (why.empty() && end != cudaSuccess) why = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(end);
  if (why.empty()) {
    const cudaError_t inst = cudaGraphInstantiate(&graph_->exec, graph, 0);
    if (inst != cudaSuccess) {
      why = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(inst);
      graph_->exec = nullptr;
    }
  }
  if (why.empty()) {
    graph_->graph = graph;
    status_ = "cuda-graph";
    MC_CUDA_CHECK(cudaGraphLaunch(graph_->exec, stream));
    return;
  }
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();  // a refused call inside the capture leaves its (non-sticky) error behind
  graph_->failed = true;
  status_ = "eager: the CUDA graph capture failed (" + why + ")";
  body();  // nothing of the capture ran: this step eagerly
#endif
}

void DecodeStep::run(const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions) {
  MC_CHECK(static_cast<int64_t>(tokens.size()) == rows_ && static_cast<int64_t>(positions.size()) == rows_,
           "DecodeStep::run: ", tokens.size(), " tokens and ", positions.size(), " positions for ", rows_, " rows");
  std::vector<int32_t> inputs(tokens.begin(), tokens.end());
  inputs.resize(2 * tokens.size());
  for (size_t r = 0; r < positions.size(); ++r) {
    MC_CHECK(positions[r] >= 0 && positions[r] < cache_.max_len, "DecodeStep::run: row ", r, " at position ",
             positions[r], " outside the cache's ", cache_.max_len);
    MC_CHECK(tokens[r] >= 0 && tokens[r] < vocab_, "DecodeStep::run: token ", tokens[r], " of row ", r,
             " is not in the vocabulary [0, ", vocab_, ")");
    inputs[tokens.size() + r] = static_cast<int32_t>(positions[r]);
  }
  std::optional<StreamGuard> guard;
  if (graph_) guard.emplace(graph_->stream);
  inputs_.copy_from(Tensor::from_vector(inputs, {2 * rows_}));
#if MOECORE_WITH_CUDA
  if (graph_ && graph_->exec) {
    MC_CUDA_CHECK(cudaGraphLaunch(graph_->exec, static_cast<cudaStream_t>(graph_->stream.handle())));
  } else if (graph_ && !graph_->failed && steps_ > 0) {  // the first step warmed up, eagerly
    capture_and_replay();
  } else {
    body();
  }
#else
  body();
#endif
  ++steps_;
  if (greedy_) {
    host_ids_ = ids_.to_vector<int32_t>();
  } else {
    host_logits_ = logits_.to_vector<float>();
  }
}

}  // namespace moecore
