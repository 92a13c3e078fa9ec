#include "moecore/moe/shared_experts.h"

#include <cmath>

#include "moecore/ops/elementwise.h"

namespace moecore {

using ops::cast_to;

SharedExperts::SharedExperts(ParamStore& store, const std::string& prefix, const ModelConfig& cfg,
                             const DenseParallel& dense)
    : enabled_(cfg.moe.shared_expert_size > 0), gated_(cfg.moe.shared_expert_gate), hidden_(cfg.hidden_size) {
  if (!enabled_) return;
  const int64_t h = cfg.hidden_size;
  const double std = cfg.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  mlp_ = Mlp(store, prefix + ".shared_experts", h, cfg.moe.shared_expert_size, cfg.swiglu, false, std, out_std, dense);
  if (gated_) {
    gate_ = Linear(store, prefix + ".shared_experts.gate", h, 1, false, std, nullptr, {}, /*fp8_eligible=*/false);
    if (dense.sp()) gate_.weight->tp_partial_grad = true;
  }
}

void SharedExperts::forward(const Tensor& x, int64_t batch, Tensor& out, Ctx& ctx) const {
  add_into(out, compute(x, batch, ctx));
}

Tensor SharedExperts::compute(const Tensor& x, int64_t batch, Ctx& ctx) const {
  const Device dev = x.device();
  const int64_t tokens = x.size(0);
  ctx.out = mlp_.forward(x, ctx.mlp, batch);
  if (!gated_) return ctx.out;
  // out += sigmoid(x w_gate) * shared: the per-token scale is a combine with one "expert" and the
  // gate as its probability.
  const DType combine = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  ctx.gate_logit = gate_.forward(x, ctx.gate);
  Tensor gate = Tensor::empty({tokens, 1}, x.dtype(), dev);
  ops::sigmoid_forward(ctx.gate_logit, gate);
  ctx.gate_prob = cast_to(gate, combine);
  // Every token to "expert" 0: the row count is known, so no host copy of the counts.
  ctx.gate_routing = ops::make_moe_routing(Tensor::zeros({tokens, 1}, DType::I32, dev), Tensor(), 1, 0, false);
  Tensor scaled = Tensor::empty({tokens, hidden_}, x.dtype(), dev);
  ops::moe_unpermute_forward(ctx.out, ctx.gate_prob, ctx.gate_routing, scaled);
  return scaled;
}

Tensor SharedExperts::backward(const Tensor& dy, Ctx& ctx) const {
  if (!gated_) return mlp_.backward(dy, ctx.mlp);
  const Device dev = dy.device();
  const int64_t tokens = dy.size(0);
  Tensor d_shared = Tensor::empty({tokens, hidden_}, dy.dtype(), dev);
  Tensor d_gate = Tensor::empty({tokens, 1}, ctx.gate_prob.dtype(), dev);
  ops::moe_unpermute_backward(ctx.out, ctx.gate_prob, ctx.gate_routing, dy, d_shared, d_gate);
  Tensor d_logit = Tensor::empty({tokens, 1}, dy.dtype(), dev);
  ops::sigmoid_backward(ctx.gate_logit, cast_to(d_gate, dy.dtype()), d_logit);
  Tensor dx = mlp_.backward(d_shared, ctx.mlp);
  add_into(dx, gate_.backward(d_logit, ctx.gate));
  return dx;
}

}  // namespace moecore
