// Per-layer MoE statistics of a training step: the balancing losses (aux, z), the tokens per
// expert after capacity dropping, and the deferred routing checks, plus what happens with them
// once per step (the cross-rank reduction, the aux-loss-free expert-bias update).
//
// Device side, so that no layer waits for the GPU per micro-batch:
//   aux_acc_, z_acc_    [1] the losses summed over the micro-batches (router dtype)
//   counts_acc_         i64 [E + 2]: tokens per expert summed on the device, then the two
//                       deferred-check flags of ops::accumulate_routing_counts (an expert index
//                       outside [0, E), an expert over its padded capacity); used when the routing
//                       plan's counts stayed on the device or were padded
//   eval_checks_        the same layout, for evaluation forwards (only the flags count)
// prefetch() copies them into pinned host memory behind the step's work; the reads (stats(),
// mutable_stats(), finish_step()) then find them there, or read the device tensors.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/core/device.h"
#include "moecore/model/config.h"
#include "moecore/model/params.h"
#include "moecore/ops/permute.h"

namespace moecore {

struct MoeStepStats {
  double aux_loss = 0;  // load-balancing loss / coeff, summed over micro-batches
  double z_loss = 0;    // z-loss / coeff, summed over micro-batches
  int64_t micro_batches = 0;
  std::vector<double> tokens_per_expert;  // assignments this step, after capacity dropping
};

class MoeStats {
 public:
  MoeStats() = default;
  // prefix names the layer in the routing checks' messages; expert_bias: router.expert_bias, or
  // null without aux-loss-free balancing.
  MoeStats(std::string prefix, const MoeConfig& moe, Param* expert_bias);

  // The router's balancing losses of one micro-batch ([1], on the device), summed there.
  void add_aux_loss(const Tensor& loss);
  void add_z_loss(const Tensor& loss);
  // After the dispatch made its plan: training counts the tokens per expert after capacity
  // dropping (Megatron counts its final routing map) and one micro-batch; evaluation keeps only
  // the plan's deferred checks. indices / kept: the router's [T, k]; pad > 0 when padded.
  void record_routing(const ops::MoeRouting& plan, const Tensor& indices, const Tensor& kept, int64_t pad,
                      bool training);

  // Once per optimizer step: expert-bias update (aux-loss-free balancing). Returns this step's
  // statistics and clears them.
  MoeStepStats finish_step();
  const MoeStepStats& stats() const;  // reads the device-side loss sums (synchronises)
  // Starts copying this step's device-side statistics into pinned host memory without waiting.
  // The trainer calls it on every layer before the gradient norm, whose read waits for the copies
  // too: the reads that follow (stats(), mutable_stats(), finish_step()) find them done instead of
  // waiting once or twice per layer (if they have not arrived, the first read waits for them).
  void prefetch();
  // Data parallelism: the trainer reduces the step's statistics over the ranks before finish_step
  // (reduce_moe_step_stats).
  MoeStepStats& mutable_stats();
  // The device path of the end of a step (no host read; train_step without pipeline stages):
  // pack_step_stats packs this step's statistics on the device (ops/moe_step_stats.h: {aux / coeff,
  // z / coeff, tokens per expert, the two routing-check flags}) and sums all but the flags over
  // token_group and dp (device collectives); finish_step_on_device averages the losses over the dp
  // ranks, applies the expert-bias update on the device and clears the step. The packed vector is
  // read later (a log step) and turned into the step's statistics by unpack_step_stats, which
  // raises the routing checks it carries.
  Tensor pack_step_stats(comm::Communicator* token_group, comm::Communicator* dp, Device dev);
  void finish_step_on_device(Tensor& packed, comm::Communicator* dp);
  MoeStepStats unpack_step_stats(const std::vector<double>& packed, int64_t micro_batches) const;
  int64_t micro_batches() const { return stats_.micro_batches; }
  // Raises the deferred routing checks of the evaluation forwards since the last read (an expert
  // index outside [0, E), an expert over its padded capacity): call after an evaluation or
  // generation, whose flags no training statistics would read. Reads a small tensor (waits).
  void check_evaluation_routing() const;

 private:
  void accumulate_loss(Tensor& acc, const Tensor& loss);
  void sync_stats() const;  // device loss sums -> stats_
  // The two flags at c[at], c[at + 1] (SIZE_MAX: at E, after the counts).
  void check_routing_flags(const std::vector<int64_t>& c, size_t at = SIZE_MAX) const;

  std::string prefix_;
  double aux_loss_coeff_ = 0, z_loss_coeff_ = 0, bias_update_rate_ = 0;
  Param* expert_bias_ = nullptr;
  mutable MoeStepStats stats_;
  mutable Tensor aux_acc_, z_acc_;  // this step's balancing losses not yet read, on the device
  mutable Tensor counts_acc_;       // see the header comment; read and checked by sync_stats
  mutable Tensor eval_checks_;      // evaluation forwards' deferred-check flags, same layout
  // prefetch(): pinned host copies of the four above (aux and z as f32/f64) and the event that
  // says they have arrived.
  mutable Tensor host_aux_, host_z_, host_counts_, host_eval_checks_;
  mutable std::shared_ptr<Event> prefetched_;
};

// The cross-rank reduction of one layer's step statistics, before finish_step: one message per
// group, [aux, z, tokens per expert...]. Each rank of a sequence's TP x CP group (token_group)
// holds its tokens' share of all three (summed); data-parallel ranks (dp) sum the counts (the
// expert bias follows the global counts) and average the losses. Null groups are skipped.
void reduce_moe_step_stats(MoeStepStats& s, comm::Communicator* token_group, comm::Communicator* dp);

}  // namespace moecore
