// The routed experts (Megatron's GroupedMLP / TEGroupedMLP): this rank's L experts as grouped
// GEMMs over the rows the token dispatcher grouped by local expert.
//
//   fc1 [L, 2F or F, H] -> weighted SwiGLU or GELU -> fc2 [L, H, F], F = the expert FFN size / ETP
//   SwiGLU experts apply each row's routing probability in the activation (a weighted SwiGLU, as
//   Megatron does; the probabilities travel with the tokens), and its backward gives the
//   probabilities' gradient; GELU experts leave the probabilities to the combine.
//   With --recompute-modules moe_act the activation output is dropped after fc2 and recomputed
//   from fc1's output in the backward (rows x F elements per layer saved).
//   Expert tensor parallelism: ETP rank r holds part r of each expert's FFN (fc1 rows per GLU
//   half, fc2 columns); its output rows are partial sums, which the dispatcher's combine sums.
//   FP8 training (model/fp8_linear.h): fc1 and fc2 run one FP8 GEMM per expert with rows (the
//   counts read on the host), each expert its own quantised operands and delayed-scaling set
//   (indexed by the global expert); a device-offset FP8 grouped kernel is later work.
#pragma once

#include <cstdint>
#include <string>

#include "moecore/comm/communicator.h"
#include "moecore/model/config.h"
#include "moecore/model/fp8_linear.h"
#include "moecore/model/params.h"
#include "moecore/ops/grouped_gemm.h"

namespace moecore {

class GroupedExperts {
 public:
  GroupedExperts() = default;
  // Adds prefix.experts.linear_fc1.weight and linear_fc2.weight: experts [first, first + local)
  // of the [E, ...] expert weights, part etp_rank of |etp| of each FFN (etp null: whole).
  GroupedExperts(ParamStore& store, const std::string& prefix, const ModelConfig& cfg, int64_t local_experts,
                 int64_t first_expert, comm::Communicator* etp);

  struct Ctx {
    Tensor input;      // the dispatched rows (for fc1's weight gradient)
    Tensor row_probs;  // SwiGLU: each row's probability [rows, 1]
    Tensor fc1_out;    // "expert_fc1"
    Tensor act;        // "moe_act" (undefined after the forward with moe_act recomputation)
    // --delay-wgrad-compute: the output gradients that backward_wgrad reads (set by a backward
    // with delay_wgrad, released by backward_wgrad).
    Tensor d_out, d_fc1;
  };

  // rows [n, H] grouped by groups; row_probs [n, 1] (SwiGLU) -> [n, H].
  Tensor forward(const Tensor& rows, const Tensor& row_probs, const ops::ExpertRows& groups, Ctx& ctx) const;
  // -> the rows' gradient [n, H]; d_row_probs: the row probabilities' gradient (SwiGLU; undefined
  // for GELU). Accumulates the weight gradients -- with delay_wgrad (--delay-wgrad-compute) not
  // here but in backward_wgrad, which the caller runs later (the same GEMMs on the same operands:
  // the same gradients).
  Tensor backward(const Tensor& d_out, const ops::ExpertRows& groups, Ctx& ctx, Tensor& d_row_probs,
                  bool delay_wgrad = false) const;
  void backward_wgrad(const ops::ExpertRows& groups, Ctx& ctx) const;

  // The GEMMs read the groups' device offsets (no host copy of the counts needed).
  bool device_rows() const;

 private:
  void activation(const Ctx& ctx, Tensor& act) const;

  bool swiglu_ = true;
  bool recompute_act_ = false;
  int64_t first_expert_ = 0;
  Fp8Linear fp8_fc1_, fp8_fc2_;  // on() with FP8 training
  int64_t hidden_ = 0;
  Param* fc1_ = nullptr;  // experts.linear_fc1.weight [L, 2F or F, H]
  Param* fc2_ = nullptr;  // experts.linear_fc2.weight [L, H, F]
};

}  // namespace moecore
