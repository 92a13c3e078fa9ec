// The MoE layer (Megatron's MoELayer): router -> token dispatch -> grouped experts -> combine,
// plus optional shared experts. x [T, H] (the normalised hidden states) -> [T, H].
//
//   router:   logits = x_r W_g^T in the router dtype (fp32, or fp64 on the CPU), x_r = x times
//             input jitter in training; --moe-router-force-load-balancing replaces the logits
//             by a round-robin pattern (benchmark mode: no router gradient).
//             top-k selection and probabilities per ops/router.h; balancing losses per
//             ops/moe_loss.h (aux/seq/global aux loss, z-loss), their gradients scaled like the
//             LM loss; aux-loss-free expert bias (selection only) updated once per step.
//   dispatch: optional capacity dropping/padding, then a permutation grouping tokens by
//             expert (ops/permute.h); with expert parallelism the tokens travel to the ranks
//             that own their experts (moe/token_dispatcher.h). The plan is kept for the backward.
//   experts:  fc1 [E, 2F or F, H] -> SwiGLU/GELU -> fc2 [E, H, F] through grouped GEMMs. SwiGLU
//             experts apply each row's routing probability in the activation (a weighted SwiGLU,
//             as Megatron does; the probabilities travel with the tokens). With
//             --recompute-modules moe_act the activation output is dropped after fc2 and
//             recomputed from fc1's output in the backward (rows x F elements per layer saved).
//   combine:  the rows summed back to their tokens; for GELU experts weighted by the routing
//             probabilities there (an unpermute with the probabilities folded in).
//   shared:   a dense MLP on every token, optionally scaled by sigmoid(x w_gate).
#pragma once

#include <memory>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/core/device.h"
#include "moecore/model/config.h"
#include "moecore/model/layers.h"
#include "moecore/moe/token_dispatcher.h"
#include "moecore/ops/permute.h"

namespace moecore {

// The process groups an MoE layer talks over (null: one rank).
// token_group (TP x CP): the ranks that share each sequence (sequence and context parallelism
// give each a part of its tokens). Balancing-loss counts are summed over it and the losses use
// its total token count, so they equal the single-rank losses; each rank's loss value (and
// gradient) is its share: its tokens' terms, summed over the group by the trainer for the log.
struct MoeParallel {
  comm::Communicator* token_group = nullptr;
  DenseParallel dense;                      // the shared expert's tensor parallelism
  comm::Communicator* ep = nullptr;         // expert-parallel group (this rank holds E / |ep| experts)
  comm::Communicator* etp = nullptr;        // expert-tensor-parallel group (a 1 / |etp| slice of each FFN)
  comm::Communicator* tp_ep = nullptr;      // the ETP x EP group (allgather dispatcher with ETP)
  DispatcherType dispatcher = DispatcherType::AllToAll;
  comm::Communicator* aux_group = nullptr;  // global_aux_loss: counts averaged over TP x DP x CP
};

struct MoeStepStats {
  double aux_loss = 0;  // load-balancing loss / coeff, summed over micro-batches
  double z_loss = 0;    // z-loss / coeff, summed over micro-batches
  int64_t micro_batches = 0;
  std::vector<double> tokens_per_expert;  // assignments this step, after capacity dropping
};

class MoeLayer {
 public:
  MoeLayer() = default;
  MoeLayer(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const MoeParallel& par = {});

  struct Ctx {
    Tensor x;                 // "moe" input
    Tensor router_in, jitter, logits, probs, indices;
    bool forced = false;
    Tensor aux_scores, aux_counts;  // for the balancing-loss backward
    Tensor combine_probs;           // probs in the combine dtype
    Tensor row_probs;               // SwiGLU experts: each expert row's probability [rows, 1]
    TokenDispatcher::Ctx dispatch;
    Tensor permuted, fc1_out, act;  // "expert_fc1" = fc1_out, "moe_act" = act
    Mlp::Ctx shared;
    Linear::Ctx gate;
    Tensor gate_logit, gate_prob, shared_out;
    ops::MoeRouting gate_routing;
  };

  // rng_seed keys the input jitter; batch gives the sequences (seq_aux_loss).
  Tensor forward(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx);
  // loss_grad_scale: d(total loss)/d(balancing loss), i.e. 1 / num_microbatches.
  Tensor backward(const Tensor& dy, double loss_grad_scale, Ctx& ctx);

  // Once per optimizer step: expert-bias update (aux-loss-free balancing) and reset of the
  // global_aux_loss counts. Returns this step's statistics and clears them.
  MoeStepStats finish_step();
  const MoeStepStats& stats() const;  // reads the device-side loss sums (synchronises)
  // Starts copying this step's device-side statistics into pinned host memory without waiting.
  // The trainer calls it on every layer before the gradient norm, whose read waits for the copies
  // too: the reads that follow (stats(), mutable_stats(), finish_step()) find them done instead of
  // waiting once or twice per layer (if they have not arrived, the first read waits for them).
  void prefetch_stats();
  // Data parallelism: the trainer reduces the step's statistics over the ranks before finish_step.
  MoeStepStats& mutable_stats();
  // Raises the deferred routing checks of the evaluation forwards since the last read (an expert
  // index outside [0, E), an expert over its padded capacity): call after an evaluation or
  // generation, whose flags no training statistics would read. Reads a small tensor (waits).
  void check_evaluation_routing() const;

 private:
  Tensor router_logits(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx) const;
  void fill_jitter(Tensor& jitter, int64_t batch, uint64_t rng_seed) const;
  Tensor balancing_counts(const Tensor& aux_scores, int64_t batch, bool training);
  // z-loss = coeff * mean over the sequences' tokens: this rank's share uses coeff / N.
  double z_loss_coeff() const { return moe_.z_loss_coeff / static_cast<double>(token_ranks_); }

  MoeConfig moe_;
  int64_t hidden_ = 0;
  bool swiglu_ = true;
  DType router_dtype_ = DType::F32;
  std::string prefix_;
  Param* gate_weight_ = nullptr;  // router.weight [E, H]
  Param* expert_bias_ = nullptr;  // router.expert_bias [E] (buffer)
  Param* fc1_ = nullptr;          // experts.linear_fc1.weight [E, 2F or F, H] (this rank's experts)
  Param* fc2_ = nullptr;          // experts.linear_fc2.weight [E, H, F]
  MoeParallel par_;
  TokenDispatcher dispatcher_;
  Mlp shared_;
  Linear shared_gate_;
  void accumulate_loss(Tensor& acc, const Tensor& loss);
  void sync_stats() const;  // device loss sums -> stats_
  void check_routing_flags(const std::vector<int64_t>& counts_and_flags) const;
  mutable MoeStepStats stats_;
  mutable Tensor aux_acc_, z_acc_;  // this step's balancing losses not yet read, on the device
  // Tokens per expert summed on the device (i64 [E + 2]: counts, then the deferred-check flags of
  // ops::accumulate_routing_counts) when the routing plan's counts stayed there or were padded;
  // read and checked by sync_stats.
  mutable Tensor counts_acc_;
  // Evaluation forwards' deferred-check flags (their counts are not statistics), same layout.
  mutable Tensor eval_checks_;
  // prefetch_stats(): pinned host copies of the four above (aux and z as f32/f64) and the event
  // that says they have arrived.
  mutable Tensor host_aux_, host_z_, host_counts_, host_eval_checks_;
  mutable std::shared_ptr<Event> prefetched_;
  Tensor global_counts_;  // global_aux_loss: counts summed over this step's micro-batches [1, E]
  int64_t global_micro_ = 0;
  int64_t token_ranks_ = 1;  // N = |token_group|
};

}  // namespace moecore
