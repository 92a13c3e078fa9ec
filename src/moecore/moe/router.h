// The MoE router (Megatron's TopKRouter): x [T, H] -> the top-k experts of each token and their
// probabilities, the balancing losses, and the capacity decision.
//
//   logits    x_r W_g^T in the router dtype (fp32, or fp64 on the CPU), x_r = x times input jitter
//             in training (Philox by global element index: every TP / CP layout draws the
//             single-rank values). On CUDA with a bf16 input, fp32 router and no jitter the GEMMs
//             run on bf16 tensor cores with each fp32 operand split into three bf16 parts
//             (MOECORE_ROUTER_GEMM=fp32 keeps the fp32 GEMMs). --moe-router-force-load-balancing
//             replaces the logits by a round-robin pattern (benchmark mode: no router gradient).
//   top-k     selection and probabilities per ops/router.h (score function, groups, scaling,
//             pre-softmax, sinkhorn in training); the aux-loss-free expert bias shifts the
//             selection only.
//   losses    aux / seq-aux / global-aux loss and z-loss per ops/moe_loss.h, summed into the
//             layer's MoeStats on the device; their gradients are scaled like the LM loss.
//   capacity  with --moe-expert-capacity-factor, kept [T, k] (and pad when padded to capacity).
// The backward takes the probabilities' gradient and adds the input gradient into dx.
#pragma once

#include <cstdint>
#include <string>

#include "moecore/model/config.h"
#include "moecore/model/params.h"
#include "moecore/moe/moe_parallel.h"
#include "moecore/moe/moe_stats.h"

namespace moecore {

class TopKRouter {
 public:
  TopKRouter() = default;
  // Adds prefix.router.weight [E, H] and, with expert bias, the buffer prefix.router.expert_bias [E].
  TopKRouter(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const MoeParallel& par);

  struct Ctx {
    Tensor router_in, jitter, logits;
    Tensor probs, indices;  // [T, k]: router dtype, i32 global expert ids
    bool forced = false;    // force-load-balancing: no router gradient
    Tensor aux_scores, aux_counts;  // for the balancing-loss backward
  };
  // What the dispatch needs: Ctx's probs and indices, and the capacity decision.
  struct Routing {
    Tensor probs, indices;
    Tensor kept;      // [T, k] u8 with capacity dropping, else undefined
    int64_t pad = 0;  // > 0: padded to this capacity
  };

  // rng_seed keys the input jitter; batch gives the sequences (seq_aux_loss). The losses of a
  // training forward are added to stats.
  Routing forward(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, MoeStats& stats, Ctx& ctx);
  // dprobs: the probabilities' gradient [T, k] (unused when forced); loss_grad_scale: d(total
  // loss)/d(balancing loss), i.e. 1 / num_microbatches. Adds the input gradient into dx [T, H].
  void backward(const Tensor& dprobs, double loss_grad_scale, Ctx& ctx, Tensor& dx);
  // Once per optimizer step: global_aux_loss starts its counts over.
  void start_step() { global_micro_ = 0; }

  Param* expert_bias() const { return expert_bias_; }

 private:
  Tensor logits(const Tensor& x, int64_t batch, bool training, uint64_t rng_seed, Ctx& ctx) const;
  void fill_jitter(Tensor& jitter, int64_t batch, uint64_t rng_seed) const;
  Tensor balancing_counts(const Tensor& aux_scores, int64_t batch, bool training);
  // z-loss = coeff * mean over the sequences' tokens: this rank's share uses coeff / N.
  double z_loss_coeff() const { return moe_.z_loss_coeff / static_cast<double>(token_ranks_); }

  MoeConfig moe_;
  int64_t hidden_ = 0;
  DType router_dtype_ = DType::F32;
  std::string prefix_;
  Param* gate_weight_ = nullptr;  // router.weight [E, H]
  Param* expert_bias_ = nullptr;  // router.expert_bias [E] (buffer)
  MoeParallel par_;
  Tensor global_counts_;  // global_aux_loss: counts summed over this step's micro-batches [1, E]
  int64_t global_micro_ = 0;
  int64_t token_ranks_ = 1;  // N = |token_group|
  mutable Tensor forced_logits_;  // force-load-balancing: the round-robin logits [T, E] of the last T
};

}  // namespace moecore
