#include "moecore/ops/router.h"

#include <cmath>

#include "moecore/ops/common.h"
#include "moecore/ops/moe_loss.h"

namespace moecore::ops {

namespace {

// What the kernels need of a config (the user-facing checks, naming the flags, are
// validate_moe_config's in model/config.cpp; they run before any op).
void check_config(const char* op, const RouterConfig& c) {
  MC_CHECK(c.num_experts > 0 && c.topk >= 1 && c.topk <= c.num_experts, op, ": config topk ", c.topk,
           " must be in [1, num_experts ", c.num_experts, "]");
  MC_CHECK(c.num_groups >= 0 && (c.num_groups > 0 || c.group_topk == 0), op, ": config num_groups ", c.num_groups,
           " must be >= 0 (group_topk ", c.group_topk, " needs groups)");
  if (c.num_groups > 0)
    MC_CHECK(c.num_experts % c.num_groups == 0 && c.group_topk >= 1 && c.group_topk <= c.num_groups &&
                 c.topk % c.group_topk == 0 && c.topk / c.group_topk <= c.num_experts / c.num_groups,
             op, ": config num_groups ", c.num_groups, " / group_topk ", c.group_topk, " do not split num_experts ",
             c.num_experts, " and topk ", c.topk, " into whole groups");
  MC_CHECK(std::isfinite(c.scaling_factor) && c.scaling_factor >= 0, op, ": config scaling_factor ", c.scaling_factor,
           " must be finite and >= 0");
}

void check_logits(const char* op, const Tensor& logits, const RouterConfig& cfg) {
  check_contiguous(op, "logits", logits);
  check_dtype(op, "logits", logits, {DType::F32, DType::F64});
  MC_CHECK(logits.ndim() == 2, op, ": argument 'logits' ", logits.describe(), " must be 2-D [tokens, experts]");
  MC_CHECK(logits.size(1) == cfg.num_experts, op, ": argument 'logits' has ", logits.size(1),
           " experts (last dim) but the config has --num-experts ", cfg.num_experts);
  if (logits.device().is_cuda()) {
    MC_CHECK(logits.dtype() == DType::F32, op, ": the CUDA router is f32 only (f64 is CPU-only)");
    MC_CHECK(cfg.num_experts <= kRouterCudaMaxExperts, op, ": the CUDA router supports at most ",
             kRouterCudaMaxExperts, " experts, got ", cfg.num_experts);
  }
}

void check_like(const char* op, const char* name, const Tensor& t, const Tensor& logits, const Shape& shape,
                DType dtype) {
  check_contiguous(op, name, t);
  check_same_device(op, logits, t);
  check_shape(op, name, t, shape);
  check_dtype(op, name, t, {dtype});
}

}  // namespace

void router_topk_forward(const Tensor& logits, const Tensor& expert_bias, const RouterConfig& cfg, Tensor& probs,
                         Tensor& indices) {
  constexpr const char* op = "router_topk_forward";
  check_config(op, cfg);
  check_logits(op, logits, cfg);
  const int64_t T = logits.size(0), E = cfg.num_experts, k = cfg.topk;
  check_like(op, "probs", probs, logits, {T, k}, logits.dtype());
  check_like(op, "indices", indices, logits, {T, k}, DType::I32);
  if (expert_bias.defined()) {
    MC_CHECK(!cfg.sinkhorn && (cfg.score == RouterScore::Sigmoid || cfg.pre_softmax), op,
             ": --moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or --moe-router-pre-softmax");
    check_like(op, "expert_bias", expert_bias, logits, {E}, logits.dtype());
  }
  if (T == 0) return;
  Tensor sel;
  if (cfg.sinkhorn) {
    sel = Tensor::empty({T, E}, logits.dtype(), logits.device());
    sinkhorn(logits, sel);
  }
  if (logits.device().is_cpu()) {
    cpu::router_topk_forward(logits, expert_bias, sel, cfg, probs, indices);
  } else {
    MC_CUDA_BACKEND(op, cuda::router_topk_forward(logits, expert_bias, sel, cfg, probs, indices));
  }
}

void router_topk_aux_forward(const Tensor& logits, const Tensor& expert_bias, const RouterConfig& cfg, Tensor& probs,
                             Tensor& indices, Tensor& aux_scores, Tensor& aux_indices) {
  constexpr const char* op = "router_topk_aux_forward";
  MC_CHECK(!cfg.sinkhorn, op, ": not for the sinkhorn router (use router_topk_forward and aux_scores_forward)");
  check_logits(op, logits, cfg);
  const int64_t T = logits.size(0), E = cfg.num_experts, k = cfg.topk;
  check_like(op, "aux_scores", aux_scores, logits, {T, E}, logits.dtype());
  check_like(op, "aux_indices", aux_indices, logits, {T, k}, DType::I32);
  if (logits.device().is_cpu()) {
    // The reference: the three separate ops.
    router_topk_forward(logits, expert_bias, cfg, probs, indices);
    if (T == 0) return;
    cpu::aux_scores_forward(logits, cfg.score, aux_scores);
    RouterConfig plain;
    plain.num_experts = E;
    plain.topk = k;
    Tensor unused = Tensor::empty({T, k}, logits.dtype());
    cpu::router_topk_forward(aux_scores, Tensor(), Tensor(), plain, unused, aux_indices);
    return;
  }
  // The same argument checks as router_topk_forward (run on the CPU path above).
  check_config(op, cfg);
  check_like(op, "probs", probs, logits, {T, k}, logits.dtype());
  check_like(op, "indices", indices, logits, {T, k}, DType::I32);
  if (expert_bias.defined()) {
    MC_CHECK(cfg.score == RouterScore::Sigmoid || cfg.pre_softmax, op,
             ": --moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or --moe-router-pre-softmax");
    check_like(op, "expert_bias", expert_bias, logits, {E}, logits.dtype());
  }
  if (T == 0) return;
  MC_CUDA_BACKEND(op, cuda::router_topk_aux_forward(logits, expert_bias, cfg, probs, indices, aux_scores, aux_indices));
}

void router_topk_backward(const Tensor& logits, const Tensor& indices, const Tensor& dprobs, const RouterConfig& cfg,
                          Tensor& dlogits) {
  constexpr const char* op = "router_topk_backward";
  check_config(op, cfg);
  check_logits(op, logits, cfg);
  const int64_t T = logits.size(0), E = cfg.num_experts, k = cfg.topk;
  check_like(op, "indices", indices, logits, {T, k}, DType::I32);
  check_like(op, "dprobs", dprobs, logits, {T, k}, logits.dtype());
  check_like(op, "dlogits", dlogits, logits, {T, E}, logits.dtype());
  if (T == 0) return;
  if (logits.device().is_cpu()) {
    cpu::router_topk_backward(logits, indices, dprobs, cfg, dlogits);
  } else {
    MC_CUDA_BACKEND(op, cuda::router_topk_backward(logits, indices, dprobs, cfg, dlogits));
  }
}

}  // namespace moecore::ops
