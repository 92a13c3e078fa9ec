// The optimizer side of data and expert parallelism: gradient reduction, the global gradient
// norm, AdamW, and the full (layout-independent) state for checkpoints.
//
// Gradients live in two flat buffers of the ParamStore (dense, expert; model/params.h).
//   dense  gradients: summed over the DP x CP group and divided by DP (an average over DP: each
//                     CP rank holds its chunks' part of the whole-sequence loss gradient).
//                     Tensor parallelism: parameters marked tp_partial_grad (sequence-parallel
//                     norms, router, row-parallel biases, q/k norms) are first summed over TP
//                     (before the data-parallel reduction, for --overlap-grad-reduce as each
//                     layer finishes, on the compute stream).
//   expert gradients: summed over the expert-data-parallel group (EDP) and scaled by 1 / DP:
//                     each expert already received the tokens of its whole EP group through
//                     the dispatcher, so EDP x EP = DP ranks' tokens enter once (Megatron's
//                     expert_gradient_scaling_factor).
// Plain (distributed = false): all-reduce each buffer; every rank keeps full AdamW state for
// the parameters it holds (its experts only, under EP).
// Distributed (--use-distributed-optimizer, ZeRO-1): each buffer is split into equal shards over
// its group (dense: DP, expert: EDP); rank i of the group owns elements [i*S, (i+1)*S).
// reduce_gradients() reduce-scatters (so a rank only receives its shard's sums), step() runs
// AdamW on the owned shard with exp_avg / exp_avg_sq allocated for that shard only (the
// ParamStore's per-parameter Adam tensors are released), then all-gathers the updated fp32
// masters. With bf16 compute (--bf16) the fp32 masters are sharded too: a rank keeps them for
// its shard only, updates its shard, casts it to bf16 and all-gathers the bf16 weights (flat
// weight buffers in the gradient layout); parameters that compute in fp32 (the router) keep a
// whole fp32 master, refreshed from the shards after each step. With fp32 compute the masters
// are the weights and stay whole, as Megatron's fp32 parameters do.
//
// Overlap (--overlap-grad-reduce): during the last micro-batch's backward
// the trainer calls layer_ready(i) as soon as decoder layer i's gradients are final; that
// layer's slices of both buffers (contiguous: a layer's parameters are registered together) are
// all-reduced at once, on a communication stream ordered after the compute stream by an event
// (GPU), so the reduction runs while the backward of the layers below goes on. With the
// distributed optimizer the layer's range is reduced instead of all-reduced: one in-place reduce
// per shard owner of a piece of the range, grouped (the uneven reduce-scatter of that range), so
// each rank ends with the sums of its shard as the reduce-scatter would give them.
// reduce_gradients() then reduces every range not yet reduced (embedding, final norm, output
// layer), makes the compute stream wait for the communication stream and applies the expert
// scale. Each element is reduced exactly once (checked).
//
// Norms: the squared gradient norm sums each element of the model once: dense from the
// reduced dense gradients (or shards, summed over DP), experts summed over EP (and EDP shards);
// with TP, split dense parameters are summed over TP and replicated ones counted once.
// Tied embeddings (groups.embedding): reduce_gradients() first sums the word-embedding gradient
// of the first and last stage over the embedding group (before the data-parallel reduction, on
// the whole local gradient: the stages' shard layouts differ), so both copies take the same step;
// the norms count the first stage's copy only.
// full_state() and load() speak the single-rank checkpoint names and full shapes, so a
// checkpoint written by any layout loads into any other.
//
// CPU offload (--optimizer-cpu-offload, offload_fraction F > 0): the optimizer keeps its state in
// shards as the distributed optimizer does (without it: one shard per buffer, the whole buffer,
// no communication; the reductions stay all-reduces). The first F of each shard's elements, cut at
// the boundary of a parameter piece nearest to F (as Megatron's hybrid optimizer assigns whole
// parameters), are updated on the host: their fp32 masters and moments live in host memory (pinned
// with CUDA), their gradients are copied there on a side stream while the device updates the rest,
// a multi-threaded host AdamW (ops/adamw_host.h: the same element function) updates them, and the
// fresh bf16 weights (fp32 compute: the masters) are copied back. The checkpoints read and write
// the host part in place: a run with offload resumes from any checkpoint and the reverse. Split
// masters (ParamStore::param_remainders) are refused with it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/model/params.h"
#include "moecore/ops/adamw.h"
#include "moecore/ops/adamw_host.h"
#include "moecore/train/checkpoint.h"
#include "moecore/train/fp8_param_gather.h"

namespace moecore {

struct OptimizerGroups {
  comm::Communicator* dp = nullptr;   // dense parameters' gradient group: DP x CP (null: one rank)
  comm::Communicator* tp = nullptr;   // the tensor-parallel group (null: TP = 1)
  comm::Communicator* edp = nullptr;  // expert parameters' data-parallel group (null: one rank)
  comm::Communicator* ep = nullptr;   // the expert-parallel group (null: every expert here)
  comm::Communicator* pp = nullptr;   // the pipeline group: norms sum over the stages
  comm::Communicator* etp = nullptr;  // the expert-tensor-parallel group (slices of each expert)
  // Tied embeddings with pipeline stages: the first (rank 0) and last (rank 1) stage of this
  // pipeline, both holding embedding.word_embeddings.weight (null: not on such a stage).
  comm::Communicator* embedding = nullptr;
  // --overlap-param-gather: communicators of their own for the parameter all-gathers (the ranks
  // of `dp` and `edp`), so that gathers still running on the communication stream never share a
  // communicator with the forward's collectives on the compute stream.
  comm::Communicator* dp_gather = nullptr;
  comm::Communicator* edp_gather = nullptr;
  int64_t dp_size = 1;  // DP: dense gradients are summed over `dp` and divided by it
};

struct AdamHyper {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

class Optimizer {
 public:
  // Call after store.initialize(dp shards, edp shards) when distributed (see shard_multiples).
  // offload_fraction: 0 (no offload) or in (0, 1]: the share of this rank's optimizer state kept
  // and updated on the host (CPU offload above).
  Optimizer(ParamStore& store, const OptimizerGroups& groups, bool distributed, bool overlap = false,
            double offload_fraction = 0.0);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  // The buffer length multiples initialize() needs for this layout: {dense, expert}.
  static std::pair<int64_t, int64_t> shard_multiples(const OptimizerGroups& groups, bool distributed);

  bool overlapping() const { return overlap_; }
  // CPU offload: {elements updated on the host, elements this rank updates} over both buffers.
  std::pair<int64_t, int64_t> offloaded_elements() const {
    return {dense_.split - dense_.begin + expert_.split - expert_.begin,
            dense_.end - dense_.begin + expert_.end - expert_.begin};
  }
  void layer_ready(int64_t layer);  // overlap: layer's gradients are final
  // --overlap-param-gather (distributed only; call before the first step): step() all-gathers the
  // updated parameters in units, each owner broadcasting its piece of a unit: everything before
  // the decoder layers (embedding), then each decoder layer, then the rest (final norm, output
  // layer). On a GPU the units run on the communication stream, each followed by an event, and
  // wait_params(unit) makes the compute stream wait for one: the model calls it with -1 before
  // the embedding, i before decoder layer i and num_layers before the final norm. On the CPU the
  // units run in place at the end of the step (the same pieces, no overlap).
  void set_overlap_param_gather(bool on);
  void wait_params(int64_t unit);
  void wait_all_params();  // the compute stream waits for every unit (before reading the weights otherwise)
  // --fp8-param-gather (call before the first step): step() all-gathers the weights of the FP8
  // linears registered with the store's Fp8Context as FP8 codes (train/fp8_param_gather.h) and the
  // rest of the weights in bf16. Needs the distributed optimizer with bf16 weights (sharded
  // masters); --overlap-param-gather and CPU offload are refused.
  void set_fp8_param_gather();
  // The last step's parameter all-gather volume (sharded masters; FP8 elements 0 without the flag).
  Fp8ParamGather::Volume param_gather_volume() const;
  void reduce_gradients();
  double grad_norm_sq();    // after reduce_gradients(); the same on every rank
  double params_norm_sq();  // fp32 masters of trainable parameters; the same on every rank
  // AdamW with gradients scaled by clip_scale, then fresh compute weights; the gradients are
  // left stale (ParamStore::mark_grads_stale: garbage until the next backward writes them or
  // reduce_gradients() zeroes what it did not write).
  void step(const AdamHyper& h, double lr, float clip_scale, int64_t step);
  // The same with the step decided on the device (ops::decide_adamw_step): the coefficients, the
  // clip coefficient and the skip flag come from device_step (a skipped step leaves every
  // parameter, moment and compute weight as it is). No host wait, except with CPU offload (its
  // host AdamW reads them after the gradients' download it waits for anyway).
  void step(const AdamHyper& h, const Tensor& device_step);
  // The squared global gradient norm as parts on the device, f32 or f64, whose sum in double is
  // grad_norm_sq(): no host read on one rank (or with replicated data parallelism); the other
  // layouts sum on the host (host collectives) and upload the total.
  Tensor grad_norm_sq_parts();

  // Collective: every rank calls; returns the full tensors (CPU) under the checkpoint names on
  // ranks that keep them (the writers), nothing elsewhere.
  std::vector<NamedTensor> full_state(bool keep = true);
  // The same one tensor at a time: sink(name, full tensor) on every rank, in state_specs()
  // order, right after each tensor is gathered (host memory: one full tensor at a time).
  void full_state(const std::function<void(const std::string& name, const Tensor& full)>& sink);
  // Name, dtype and full shape of every tensor full_state() produces, in its order.
  std::vector<TensorSpec> state_specs() const;
  void load(const TensorFetch& fetch, bool model_only);

 private:
  struct Shard {  // one flat buffer's part owned by this rank (distributed)
    comm::Communicator* group = nullptr;
    int64_t begin = 0, end = 0;
    Tensor grad, exp_avg, exp_avg_sq;  // [end - begin]
    Tensor master;                     // sharded masters: the fp32 masters of [begin, end)
    Tensor weights;                    // sharded masters: every bf16 weight, flat (whole buffer)
    // Sharded split masters (ParamStore::param_remainders): the int16 remainders of [begin, end);
    // `weights` is the store's high-half buffer, `master` undefined.
    Tensor remainder;
    // CPU offload: [begin, split) lives on the host and exp_avg, exp_avg_sq, master hold
    // [split, end) only (split == begin: nothing offloaded). The host tensors hold [begin, split):
    // master (fp32 compute: a copy of the device masters), moments, a copy of the gradients, and
    // with sharded masters the updated bf16 weights on their way to the device.
    int64_t split = 0;
    Tensor host_master, host_grad, host_exp_avg, host_exp_avg_sq, host_weights;
    // The elements [lo, hi) of a state kept as a device part and a host part (within one part).
    Tensor state(const Tensor& device_part, const Tensor& host_part, int64_t lo, int64_t hi) const;
  };
  void shard_masters();  // sets up the sharded-masters mode (constructor)
  int64_t numel(const Param& p) const { return p.grad.numel(); }
  bool is_expert_group_split(const Param& p) const { return p.expert && groups_.ep != nullptr; }
  Shard& shard_of(const Param& p) { return p.expert ? expert_ : dense_; }
  Tensor& master_buffer_of(const Param& p) { return master_buffer_of_kind(p.expert); }
  Tensor& master_buffer_of_kind(bool expert) { return expert ? store_.expert_master_buffer() : store_.master_buffer(); }
  Tensor full_rows(const Param& p, const Tensor& local);  // gathers an expert tensor over ETP, then EP
  // One parameter's whole state from a shard state kept as a device and a host part.
  Tensor param_state(const Param& p, Shard& s, const Tensor& device_part, const Tensor& host_part);
  Tensor shard_master(const Param& p);  // sharded masters: one parameter's whole fp32 master
  // Squares of the fp32 masters joined from flat halves starting at element `begin` of a buffer.
  double host_grad_norm_sq();  // grad_norm_sq_parts() of the other layouts: host sums
  double joined_squares(bool expert, const Tensor& high, const Tensor& remainder, int64_t begin);
  struct Range {
    int64_t begin = 0, end = 0;  // elements of one flat buffer
  };
  void compute_layer_ranges();  // layer_dense_, layer_expert_ (overlap)
  // One parameter's whole tensor from the shards: fill(part, dst) writes this rank's elements
  // `part` (of the flat buffer) into dst; zeros elsewhere, summed over the shard group.
  Tensor assemble(const Param& p, Shard& s, const std::function<void(Range part, Tensor& dst)>& fill);
  // Parameter gathering (--overlap-param-gather): the units in order, their events, the buffer each
  // gathers into (the bf16 weights with sharded masters, else the masters) and one range's gather.
  struct GatherUnit {
    std::vector<Range> dense, expert;  // pieces of each buffer
  };
  std::vector<GatherUnit> gather_units_;
  std::vector<std::unique_ptr<Event>> gather_events_;
  bool overlap_param_gather_ = false, gathers_pending_ = false;
  std::unique_ptr<Fp8ParamGather> fp8_gather_;  // --fp8-param-gather
  void gather_fp8_params(bool split);
  Tensor& gathered_buffer(bool expert);
  void gather_range(bool expert, Range r);
  void start_param_gather();
  // Reduces [begin, end) of the dense (expert = false) or expert buffer; records it as done.
  void reduce_range(bool expert, Range r);

  // CPU offload (see above).
  int64_t offload_split(const Shard& s, bool expert) const;  // where the host part ends
  void setup_offload(Shard& s, bool expert);                  // the host tensors (constructor)
  void start_grad_download();                                 // device gradients -> host_grad
  // The host AdamW of every offloaded piece, then the fp32-compute masters back to the device.
  // device_step (may be null): the step decided on the device instead of clip_scale.
  void step_host(std::vector<ops::HostAdamWPiece>& pieces, float clip_scale, const Tensor* device_step);
  void step_with(const AdamHyper& h, double lr, float clip_scale, int64_t step, const Tensor* device_step);
  // Sharded masters: the shard's bf16 weights [begin, end) into dst (the device part cast, the
  // host part copied from host_weights).
  void shard_weights(Shard& s, Tensor& dst);
  Tensor shard_master_values(Shard& s);  // sharded masters: the shard's fp32 masters, whole
  bool offloaded() const { return offload_fraction_ > 0; }
  double offload_fraction_ = 0;
  Stream offload_stream_;  // CUDA: the gradients' copies to the host
  bool has_offload_stream_ = false;
  std::unique_ptr<Event> downloaded_;

  ParamStore& store_;
  OptimizerGroups groups_;
  bool distributed_ = false;
  bool sharded_ = false;  // state in Shards: distributed, or offloaded
  bool sharded_masters_ = false;  // distributed with bf16 compute
  Shard dense_, expert_;
  bool overlap_ = false;
  std::vector<Range> layer_dense_, layer_expert_;  // per decoder layer (empty range: none)
  std::vector<Range> done_dense_, done_expert_;    // reduced so far this step
  Stream comm_stream_;
  bool has_comm_stream_ = false;
  // Tied embeddings: this stage's word-embedding range of the dense buffers, and whether the norms
  // count it (first stage) or leave it to the first stage (last stage).
  Range tied_{};
  bool tied_counted_ = true;
  void reduce_tied_embedding();
  // TP: sums the tp_partial_grad gradients of decoder layer `layer` (-1: every parameter not done yet).
  void reduce_tensor_parallel(int64_t layer);
  std::vector<bool> tp_done_;  // per store parameter, this step
  // Squares of t = dense elements [t_begin, ...), counting what this rank must count; with TP the
  // caller sums the result over TP (replicated parameters enter with weight 1 / TP).
  double dense_squares(const Tensor& t, int64_t t_begin);
  // Dense reductions are plain averages (the gradient group is the DP group itself).
  bool dense_averages() const { return !groups_.dp || groups_.dp->size() == groups_.dp_size; }
};

}  // namespace moecore
