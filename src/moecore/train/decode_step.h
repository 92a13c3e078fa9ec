// One decoding step of every row of a KV cache (GPTModel::decode_logits), for the token loop of
// train/generation.cpp: the new tokens and positions go from the host into fixed device
// buffers, the model runs, its logits are cast into a fixed f32 buffer [R, V] and, for greedy
// decoding, reduced to each row's first largest logit (ops::argmax_rows) so that only R ids
// come back to the host instead of R x V logits.
//
// CUDA graphs (use_graph, on a GPU): a decoding step is hundreds of small launches, so the host's
// launch work, not the GPU, sets its time. The first step runs eagerly on a stream of the
// step's own (every lazy initialisation happens there: cuBLASLt's workspace for that stream,
// kernel attributes, the MoE evaluation flags); the second is captured into a graph (the
// allocations it makes come from that stream's cache: blocks freed during the capture are
// handed out again only to later requests on the same stream, and only this class runs work
// there, so every address the graph uses stays valid and unchanged) and every step from then
// replays it: copy the inputs, one cudaGraphLaunch, read the outputs. Nothing may read device
// values on the host inside the step; an op that does (a capacity-factor MoE layer, expert
// GEMMs without device-side offsets: f32, or another GPU than Hopper) makes the capture fail,
// and the steps then run eagerly on the same stream (graph_status() says why). Graph and eager
// steps run the same kernels in the same order on the same data: the same logits bit for bit.
// One DecodeStep at a time holds a device's graph stream; another one made meanwhile runs
// eagerly. The token ids the step embeds must be valid (the generation loop samples them from
// the vocabulary): the embedding's range check, a read of a device flag, is skipped.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "moecore/model/gpt.h"

namespace moecore {

class DecodeStep {
 public:
  DecodeStep(GPTModel& model, GPTModel::KvCache& cache, Device device, bool greedy, bool use_graph);
  ~DecodeStep();
  DecodeStep(const DecodeStep&) = delete;
  DecodeStep& operator=(const DecodeStep&) = delete;

  // Row r's new token tokens[r] at position positions[r] (one per cache row).
  void run(const std::vector<int32_t>& tokens, const std::vector<int64_t>& positions);
  // After run: greedy, each row's token (the first largest logit); else the logits [R, V] f32.
  const std::vector<int32_t>& greedy_tokens() const { return host_ids_; }
  const std::vector<float>& logits() const { return host_logits_; }
  // The last step's f32 logits [R, V] on the device (read with the step's stream current: tests).
  Tensor device_logits() const;
  // "cuda-graph" (replaying a captured graph), "eager" (no graph asked for, or the CPU), or
  // "eager: " + why the graph is not used.
  const std::string& graph_status() const { return status_; }
  bool replaying() const;

 private:
  void body();
  void capture_and_replay();

  GPTModel& model_;
  GPTModel::KvCache& cache_;
  Device device_;
  bool greedy_;
  int64_t rows_, vocab_;
  Tensor inputs_, tokens_, positions_, logits_, ids_;  // fixed device buffers (tokens_, positions_: views of inputs_)
  std::vector<int32_t> host_ids_;
  std::vector<float> host_logits_;
  std::string status_;
  int64_t steps_ = 0;
  struct Graph;  // the stream and the captured graph (CUDA builds)
  std::unique_ptr<Graph> graph_;
};

}  // namespace moecore
