// MoE router: top-k expert selection with Megatron-Core's score functions, and its backward.
//
// logits [T, E] (f32; f64 on the CPU for gradient checks); expert_bias [E] of the same dtype or
// an undefined Tensor; probs [T, k] (logits dtype); indices [T, k] i32 in descending order of the
// selection score, ties broken by the lower expert id. With b the expert bias (0 when absent):
//   softmax, pre_softmax: s = softmax(logits); select topk(s + b); probs = s at the selection.
//   softmax (default):    select topk(logits); probs = softmax over the k selected logits.
//   sigmoid:              s = sigmoid(logits); select topk(s + b);
//                         probs = s_sel / (sum s_sel + 1e-20) if k > 1, else s_sel.
//   sinkhorn (training):  select topk(sinkhorn(logits)) (moe_loss.h; all T rows are coupled);
//                         probs = softmax(logits) over all E at the selection if k > 1,
//                         sigmoid(logit) if k == 1 (Megatron's sinkhorn_load_balancing).
//   group-limited (num_groups G > 0): the selection scores (logits / s / s + b) viewed [T, G, E/G];
//     group score = sum of the top (k / group_topk) scores of the group; the best group_topk
//     groups are kept (ties: lower group id), the other experts masked to -inf; then top-k.
//   finally probs *= scaling_factor when it is set (non-zero).
// Expert bias is allowed with sigmoid or pre_softmax only (aux-loss-free balancing).
// Backward: dlogits [T, E] (overwritten) from dprobs [T, k] through the probability formula
// with the selection (indices from the forward) held fixed; logits outside the selection get
// 0 unless the formula involves all E (pre_softmax, sinkhorn with k > 1).
// CUDA: f32 only, E <= 1024; one warp per token row (k-pass arg-max, group limits in the same
// kernel). Sinkhorn selection runs ops::sinkhorn first (one extra kernel).
//
// router_topk_aux_forward: the training forward with a balancing loss in one pass per row
// (one kernel on CUDA instead of three): probs and indices exactly as router_topk_forward;
// aux_scores [T, E] (logits dtype) exactly as ops::aux_scores_forward(logits, cfg.score)
// (moe_loss.h: softmax over E, or sigmoid normalised over E; no expert bias); aux_indices [T, k]
// i32: the plain top-k of each aux_scores row (descending, ties: lower expert id), the selection
// ops::topk_counts counts (pass it to ops::topk_counts_from_indices). Not for sinkhorn. It has no
// backward of its own: router_topk_backward and aux_scores_backward give the gradients.
#pragma once

#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore::ops {

enum class RouterScore { Softmax, Sigmoid };

struct RouterConfig {
  int64_t num_experts = 0;
  int64_t topk = 1;
  RouterScore score = RouterScore::Softmax;
  bool pre_softmax = false;     // softmax only: probs = topk(softmax(logits)), not renormalised
  int64_t num_groups = 0;       // group-limited routing: 0 = off
  int64_t group_topk = 0;       // groups kept per token
  double scaling_factor = 0.0;  // 0 = unset; else probs *= scaling_factor
  bool sinkhorn = false;        // selection by sinkhorn-normalised scores (training)
};

// The ops check only what their kernels need of a config (an Error in the op's terms); the
// combinations of router flags, named by flag, are checked by validate_moe_config (model/config.h).

void router_topk_forward(const Tensor& logits, const Tensor& expert_bias, const RouterConfig& cfg, Tensor& probs,
                         Tensor& indices);
void router_topk_backward(const Tensor& logits, const Tensor& indices, const Tensor& dprobs, const RouterConfig& cfg,
                          Tensor& dlogits);
void router_topk_aux_forward(const Tensor& logits, const Tensor& expert_bias, const RouterConfig& cfg, Tensor& probs,
                             Tensor& indices, Tensor& aux_scores, Tensor& aux_indices);

// Largest E the CUDA kernels take (shared memory per warp grows with E).
inline constexpr int64_t kRouterCudaMaxExperts = 1024;

namespace cpu {
// sel_scores: undefined, or [T, E] scores that replace the selection scores (sinkhorn).
void router_topk_forward(const Tensor& logits, const Tensor& expert_bias, const Tensor& sel_scores,
                         const RouterConfig& cfg, Tensor& probs, Tensor& indices);
void router_topk_backward(const Tensor& logits, const Tensor& indices, const Tensor& dprobs, const RouterConfig& cfg,
                          Tensor& dlogits);
}  // namespace cpu
namespace cuda {
void router_topk_forward(const Tensor& logits, const Tensor& expert_bias, const Tensor& sel_scores,
                         const RouterConfig& cfg, Tensor& probs, Tensor& indices);
void router_topk_aux_forward(const Tensor& logits, const Tensor& expert_bias, const RouterConfig& cfg, Tensor& probs,
                             Tensor& indices, Tensor& aux_scores, Tensor& aux_indices);
void router_topk_backward(const Tensor& logits, const Tensor& indices, const Tensor& dprobs, const RouterConfig& cfg,
                          Tensor& dlogits);
}  // namespace cuda

}  // namespace moecore::ops
