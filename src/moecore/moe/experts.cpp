#include "moecore/moe/experts.h"

#include <cmath>
#include <optional>

#include "moecore/core/memory_categories.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/swiglu.h"

namespace moecore {

namespace {
using ops::expert_matrix;

// fn(e, rows) for each local expert e in order, rows: its slice [begin, end) of the permuted rows
// (empty for an expert without rows). The FP8 path reads the per-expert counts on the host (its
// experts report device_rows() false), on a GPU too: this first GPU version runs one cuBLASLt FP8
// GEMM per expert; a grouped FP8 GEMM reading the offsets on the device is later work.
template <class Fn>
void for_each_expert(const ops::ExpertRows& groups, Fn&& fn) {
  int64_t r0 = 0;
  const std::vector<int64_t>& counts = groups.counts();
  for (size_t e = 0; e < counts.size(); r0 += counts[e], ++e) fn(static_cast<int64_t>(e), r0, r0 + counts[e]);
}

// The grouped GEMMs in FP8: one Fp8Linear GEMM per expert with rows (first: the global index of
// local expert 0, which names its delayed-scaling state).
// The weights' operands come from one quantisation of all experts where the recipe allows
// (Fp8Linear::expert_weight_operands), else per expert inside the GEMM calls.
void fp8_forward(const Fp8Linear& f, const Tensor& x, const Tensor& w, const ops::ExpertRows& groups, Tensor& out,
                 int64_t first) {
  const std::vector<ops::Fp8Tensor> wq = f.expert_weight_operands(w);
  for_each_expert(groups, [&](int64_t e, int64_t b, int64_t end) {
    if (end == b) return;
    Tensor y = out.slice(0, b, end);
    if (wq.empty()) f.forward(x.slice(0, b, end), expert_matrix(w, e), y, first + e);
    else f.forward(x.slice(0, b, end), wq[static_cast<size_t>(e)], y, first + e);
  });
}

void fp8_dgrad(const Fp8Linear& f, const Tensor& dy, const Tensor& w, const ops::ExpertRows& groups, Tensor& dx,
               int64_t first) {
  const std::vector<ops::Fp8Tensor> wq = f.expert_weight_operands(w);
  for_each_expert(groups, [&](int64_t e, int64_t b, int64_t end) {
    if (end == b) return;
    Tensor d = dx.slice(0, b, end);
    if (wq.empty()) f.dgrad(dy.slice(0, b, end), expert_matrix(w, e), d, 0.0f, first + e);
    else f.dgrad(dy.slice(0, b, end), ops::fp8_transpose(wq[static_cast<size_t>(e)]), d, 0.0f, first + e);
  });
}

// dw_e (+)= dy_e^T x_e; an expert without rows keeps its gradient (accumulate) or gets zeros.
void fp8_wgrad(const Fp8Linear& f, const Tensor& dy, const Tensor& x, const ops::ExpertRows& groups, Tensor& dw,
               bool accumulate, int64_t first) {
  for_each_expert(groups, [&](int64_t e, int64_t b, int64_t end) {
    Tensor g = expert_matrix(dw, e);
    if (end == b) {
      if (!accumulate) ops::fill(g, 0.0);
      return;
    }
    f.wgrad(dy.slice(0, b, end), x.slice(0, b, end), g, accumulate ? 1.0f : 0.0f, first + e);
  });
}
}  // namespace

GroupedExperts::GroupedExperts(ParamStore& store, const std::string& prefix, const ModelConfig& cfg,
                               int64_t local_experts, int64_t first_expert, comm::Communicator* etp_group)
    : swiglu_(cfg.swiglu), recompute_act_(cfg.moe.recompute_act), first_expert_(first_expert), hidden_(cfg.hidden_size) {
  const int64_t e = cfg.moe.num_experts, h = cfg.hidden_size, f = cfg.moe.ffn_hidden_size;
  const double std = cfg.init_method_std, out_std = std / std::sqrt(2.0 * static_cast<double>(cfg.num_layers));
  // This rank's experts: rows [first, first + L) of the [E, ...] expert weights.
  // With ETP, part r of each expert's FFN: fc1 rows (per GLU half), fc2 columns.
  const int64_t etp = etp_group ? etp_group->size() : 1, etp_rank = etp_group ? etp_group->rank() : 0;
  MC_CHECK(f % etp == 0, "--moe-ffn-hidden-size ", f, " is not divisible by --expert-tensor-parallel-size ", etp);
  const int64_t fl = f / etp;
  fc1_ = &store.add_expert(prefix + ".experts.linear_fc1.weight", {local_experts, swiglu_ ? 2 * fl : fl, h}, e,
                           first_expert, std, etp, etp_rank, 1, swiglu_);
  fc2_ = &store.add_expert(prefix + ".experts.linear_fc2.weight", {local_experts, h, fl}, e, first_expert, out_std, etp,
                           etp_rank, 2);
  if (store.fp8()) {  // delayed state for all E experts on every rank (filled by the step's max over the ranks)
    fp8_fc1_ = Fp8Linear(*store.fp8(), store, prefix + ".experts.linear_fc1", e, etp > 1 ? etp_group : nullptr, h,
                         swiglu_ ? 2 * fl : fl);
    fp8_fc2_ = Fp8Linear(*store.fp8(), store, prefix + ".experts.linear_fc2", e, etp > 1 ? etp_group : nullptr, fl, h);
    fp8_fc1_.gather_weight(*fc1_, first_expert, local_experts);  // --fp8-param-gather only
    fp8_fc2_.gather_weight(*fc2_, first_expert, local_experts);
  }
}

bool GroupedExperts::device_rows() const {
  if (fp8_fc1_.on()) return false;  // the FP8 loop reads the counts on the host
  return ops::grouped_gemm_device_rows(fc1_->weight) && ops::grouped_gemm_device_rows(fc2_->weight);
}

void GroupedExperts::activation(const Ctx& ctx, Tensor& act) const {
  if (swiglu_) {
    ops::weighted_swiglu_forward(ctx.fc1_out, ctx.row_probs, act);
  } else {
    ops::gelu_forward(ctx.fc1_out, act);
  }
}

Tensor GroupedExperts::forward(const Tensor& rows, const Tensor& row_probs, const ops::ExpertRows& groups,
                               Ctx& ctx) const {
  const Device dev = rows.device();
  const int64_t n = rows.size(0);
  ctx.input = rows;
  ctx.row_probs = row_probs;
  std::optional<MemoryCategoryScope> module(std::in_place, ActivationModule::kExpertFc1);
  ctx.fc1_out = Tensor::empty({n, fc1_->shape[1]}, rows.dtype(), dev);
  if (fp8_fc1_.on()) {
    fp8_forward(fp8_fc1_, rows, fc1_->weight, groups, ctx.fc1_out, first_expert_);
  } else {
    ops::grouped_gemm_forward(rows, fc1_->weight, groups, ctx.fc1_out);
  }
  module.emplace(ActivationModule::kMoeAct);
  ctx.act = Tensor::empty({n, fc2_->shape[2]}, rows.dtype(), dev);
  activation(ctx, ctx.act);
  module.emplace(ActivationModule::kExpertFc2);
  Tensor out = Tensor::empty({n, hidden_}, rows.dtype(), dev);
  if (fp8_fc2_.on()) {
    fp8_forward(fp8_fc2_, ctx.act, fc2_->weight, groups, out, first_expert_);
  } else {
    ops::grouped_gemm_forward(ctx.act, fc2_->weight, groups, out);
  }
  if (recompute_act_) ctx.act = Tensor();  // --recompute-modules moe_act: rebuilt in the backward
  return out;
}

Tensor GroupedExperts::backward(const Tensor& d_out, const ops::ExpertRows& groups, Ctx& ctx,
                                Tensor& d_row_probs, bool delay_wgrad) const {
  const Device dev = d_out.device();
  if (!ctx.act.defined()) {  // recompute the activation from the kept fc1 output
    ctx.act = Tensor::empty({ctx.fc1_out.size(0), fc2_->shape[2]}, d_out.dtype(), dev);
    activation(ctx, ctx.act);
  }
  Tensor d_act = Tensor::empty(ctx.act.shape(), d_out.dtype(), dev);
  if (fp8_fc2_.on()) {
    fp8_dgrad(fp8_fc2_, d_out, fc2_->weight, groups, d_act, first_expert_);
    if (!delay_wgrad) fp8_wgrad(fp8_fc2_, d_out, ctx.act, groups, fc2_->grad, fc2_->grad_accumulates(), first_expert_);
  } else {
    ops::grouped_gemm_dgrad(d_out, fc2_->weight, groups, d_act);
    if (!delay_wgrad) ops::grouped_gemm_wgrad(d_out, ctx.act, groups, fc2_->grad, fc2_->grad_accumulates());
  }
  Tensor d_fc1 = Tensor::empty(ctx.fc1_out.shape(), d_out.dtype(), dev);
  d_row_probs = Tensor();
  if (swiglu_) {
    d_row_probs = Tensor::empty(ctx.row_probs.shape(), ctx.row_probs.dtype(), dev);
    ops::weighted_swiglu_backward(ctx.fc1_out, ctx.row_probs, d_act, d_fc1, d_row_probs);
  } else {
    ops::gelu_backward(ctx.fc1_out, d_act, d_fc1);
  }
  Tensor d_rows = Tensor::empty(ctx.input.shape(), d_out.dtype(), dev);
  if (fp8_fc1_.on()) {
    fp8_dgrad(fp8_fc1_, d_fc1, fc1_->weight, groups, d_rows, first_expert_);
    if (!delay_wgrad) fp8_wgrad(fp8_fc1_, d_fc1, ctx.input, groups, fc1_->grad, fc1_->grad_accumulates(), first_expert_);
  } else {
    ops::grouped_gemm_dgrad(d_fc1, fc1_->weight, groups, d_rows);
    if (!delay_wgrad) ops::grouped_gemm_wgrad(d_fc1, ctx.input, groups, fc1_->grad, fc1_->grad_accumulates());
  }
  if (delay_wgrad) {
    ctx.d_out = d_out;
    ctx.d_fc1 = d_fc1;
  }
  return d_rows;
}

void GroupedExperts::backward_wgrad(const ops::ExpertRows& groups, Ctx& ctx) const {
  MC_CHECK(ctx.d_out.defined() && ctx.d_fc1.defined(), "GroupedExperts::backward_wgrad without a delayed backward");
  if (fp8_fc2_.on()) {
    fp8_wgrad(fp8_fc2_, ctx.d_out, ctx.act, groups, fc2_->grad, fc2_->grad_accumulates(), first_expert_);
  } else {
    ops::grouped_gemm_wgrad(ctx.d_out, ctx.act, groups, fc2_->grad, fc2_->grad_accumulates());
  }
  if (fp8_fc1_.on()) {
    fp8_wgrad(fp8_fc1_, ctx.d_fc1, ctx.input, groups, fc1_->grad, fc1_->grad_accumulates(), first_expert_);
  } else {
    ops::grouped_gemm_wgrad(ctx.d_fc1, ctx.input, groups, fc1_->grad, fc1_->grad_accumulates());
  }
  ctx.d_out = ctx.d_fc1 = Tensor();
}

}  // namespace moecore
