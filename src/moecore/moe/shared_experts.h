// The shared experts (Megatron's SharedExpertMLP): a dense MLP on every token, added to the routed
// experts' output, optionally scaled per token by sigmoid(x w_gate) (--moe-shared-expert-gate).
// The scale is a combine with one "expert" and the gate as its probability
// (ops::moe_unpermute_forward over a plan that sends every token to expert 0).
// With tensor parallelism the MLP is split like the dense MLP; with sequence parallelism the gate
// sees this rank's tokens only (its weight gradient is a partial sum over TP).
#pragma once

#include <cstdint>
#include <string>

#include "moecore/model/config.h"
#include "moecore/model/layers.h"
#include "moecore/ops/permute.h"

namespace moecore {

class SharedExperts {
 public:
  SharedExperts() = default;
  // Adds prefix.shared_experts.* when cfg.moe.shared_expert_size > 0 (else enabled() is false).
  SharedExperts(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, const DenseParallel& dense);

  struct Ctx {
    Mlp::Ctx mlp;
    Linear::Ctx gate;
    Tensor gate_logit, gate_prob, out;
    ops::MoeRouting gate_routing;
  };

  bool enabled() const { return enabled_; }
  // out [T, H] += the shared experts' output for x [T, H] (batch: the sequences in x).
  void forward(const Tensor& x, int64_t batch, Tensor& out, Ctx& ctx) const;
  // The shared experts' output [T, H] itself (forward adds it to out): --moe-shared-expert-overlap
  // computes it while the routed tokens travel and adds it after the combine, the same sum.
  Tensor compute(const Tensor& x, int64_t batch, Ctx& ctx) const;
  // -> their input gradient for dy [T, H].
  Tensor backward(const Tensor& dy, Ctx& ctx) const;

 private:
  bool enabled_ = false, gated_ = false;
  int64_t hidden_ = 0;
  Mlp mlp_;
  Linear gate_;
};

}  // namespace moecore
