#include "moecore/model/fp8_linear.h"

#include <algorithm>
#include <cmath>
#include <memory>

namespace moecore {

namespace {
using ops::Fp8Format;
using ops::Fp8Tensor;

// cuBLASLt's FP8 GEMMs want the linear's features (forward K and N, dgrad's N and K) multiples of
// 16 (ops/fp8_gemm_cuda.cpp); the rows (wgrad's K, an expert's share of the tokens) fp8_gemm pads.
constexpr int64_t kCudaFp8KMultiple = 16;
}  // namespace

bool is_fp8_scaling_state(const std::string& name) {
  auto ends = [&](const std::string& suffix) {
    return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends(".fp8_amax_history") || ends(".fp8_scale");
}

void Fp8Context::finish_step(comm::Communicator* tp, comm::Communicator* dp_cp) {
  if (cfg_.recipe != Fp8Config::Recipe::Delayed || states_.empty()) return;
  // Everything on the histories' device: the newest amaxes gathered, reduced (Max), written back
  // and the update run there (ops/fp8_quant.h), no value read on the host.
  int64_t rows = 0;
  for (const State& s : states_) rows += s.history->master.size(0);
  Tensor newest = Tensor::empty({rows}, DType::F32, states_.front().history->master.device());
  int64_t at = 0;
  for (const State& s : states_) {
    Tensor part = newest.slice(0, at, at + s.history->master.size(0));
    ops::history_newest(s.history->master, part);
    at += s.history->master.size(0);
  }
  if (tp && tp->size() > 1) tp->all_reduce(newest, comm::ReduceOp::Max);
  if (dp_cp && dp_cp->size() > 1) dp_cp->all_reduce(newest, comm::ReduceOp::Max);
  ops::DelayedScalingUpdate u;
  u.x_w_fp8_max = ops::fp8_max(Fp8Format::E4M3);
  u.grad_fp8_max = ops::fp8_max(cfg_.hybrid ? Fp8Format::E5M2 : Fp8Format::E4M3);
  u.amax_compute_max = cfg_.amax_compute_max;
  u.margin = cfg_.margin;
  at = 0;
  for (const State& s : states_) {
    const int64_t n = s.history->master.size(0);
    ops::delayed_scaling_update(s.history->master, s.scale->master, newest.slice(0, at, at + n), u);
    at += n;
  }
}

Fp8GatheredWeight& Fp8Context::add_gathered_weight(const Fp8GatheredWeight& w) {
  for (const auto& g : gathered_)
    MC_CHECK(g->weight != w.weight, "--fp8-param-gather: the weight '", w.weight->name,
             "' is shared by two FP8 linears (each would need its own FP8 copy): train without --fp8-param-gather");
  gathered_.push_back(std::make_unique<Fp8GatheredWeight>(w));
  return *gathered_.back();
}

void Fp8Context::invalidate_gathered_weights() {
  for (const auto& g : gathered_) g->valid = false;
}

void Fp8Linear::gather_weight(Param& w, int64_t first_set, int64_t sets) {
  if (!ctx_ || !ctx_->param_gather()) return;
  MC_CHECK(w.shape == (sets == 1 && w.shape.size() == 2 ? Shape{out_, in_} : Shape{sets, out_, in_}),
           "--fp8-param-gather: '", w.name, "' is ", shape_str(w.shape), " for ", sets, " [", out_, ", ", in_, "] matrices");
  Fp8GatheredWeight g;
  g.weight = &w;
  g.first_set = first_set;
  g.sets = sets;
  g.out = out_;
  g.in = in_;
  g.amax_group = amax_group_;
  g.scale = scale_;
  gathered_ = &ctx_->add_gathered_weight(g);
}

Fp8Linear::Fp8Linear(Fp8Context& ctx, ParamStore& store, const std::string& name, int64_t sets,
                     comm::Communicator* amax_group, int64_t in, int64_t out)
    : ctx_(&ctx), amax_group_(amax_group), in_(in), out_(out) {
  MC_CHECK(!store.device().is_cuda() || (in % kCudaFp8KMultiple == 0 && out % kCudaFp8KMultiple == 0),
           "FP8 training on ", store.device().str(), ": '", name, "' has ", in, " input and ", out,
           " output features on this rank; cuBLASLt's FP8 GEMMs need multiples of ", kCudaFp8KMultiple,
           ": change the model's sizes, train in bf16, or add --device cpu");
  if (ctx.config().recipe != Fp8Config::Recipe::Delayed) return;
  history_ = &store.add_buffer(name + ".fp8_amax_history", {3 * sets, ctx.config().amax_history_len});
  scale_ = &store.add_buffer(name + ".fp8_scale", {3 * sets});
  ctx.add_state(history_, scale_);
}

Fp8Format Fp8Linear::grad_format() const { return ctx_->config().hybrid ? Fp8Format::E5M2 : Fp8Format::E4M3; }

Fp8Tensor Fp8Linear::quantize_per_tensor(const Tensor& t, Role role, int64_t set, Fp8Format f) const {
  if (ctx_->config().recipe == Fp8Config::Recipe::Tensorwise) {
    Tensor a = ops::amax_tensor(t);
    if (amax_group_ && amax_group_->size() > 1) amax_group_->all_reduce(a, comm::ReduceOp::Max);
    return ops::quantize_per_tensor(t, a, ops::Fp8ScaleFrom::Amax, f);
  }
  const int64_t row = 3 * set + role;
  if (ctx_->recording()) ops::record_amax(t, history_->master, row);
  return ops::quantize_per_tensor(t, scale_->master.slice(0, row, row + 1), ops::Fp8ScaleFrom::Stored, f);
}

Fp8Tensor Fp8Linear::weight_operand(const Tensor& w, int64_t set, bool transposed) const {
  if (gathered_ && gathered_->valid) {  // the gathered operand: what the branch below would compute
    const int64_t i = set - gathered_->first_set;
    MC_CHECK(i >= 0 && i < gathered_->sets, "--fp8-param-gather: set ", set, " of '", gathered_->weight->name,
             "' is not on this rank");
    const Fp8Tensor& q = gathered_->operands[static_cast<size_t>(i)];
    if (ctx_->config().recipe == Fp8Config::Recipe::Delayed && ctx_->recording())
      ops::record_amax(gathered_->amax.slice(0, i, i + 1), history_->master, 3 * set + kWeight);
    return transposed ? ops::fp8_transpose(q) : q;
  }
  Fp8Tensor q = ctx_->config().recipe == Fp8Config::Recipe::Blockwise
                    ? ops::quantize_blocks(w, Fp8Format::E4M3)
                    : quantize_per_tensor(w, kWeight, set, Fp8Format::E4M3);
  return transposed ? ops::fp8_transpose(q) : q;
}

Fp8Tensor Fp8Linear::activation_operand(const Tensor& t, Role role, int64_t set, bool transposed) const {
  const Fp8Format f = role == kGrad ? grad_format() : Fp8Format::E4M3;
  if (ctx_->config().recipe == Fp8Config::Recipe::Blockwise) return ops::quantize_tiles(t, f, transposed);
  Fp8Tensor q = quantize_per_tensor(t, role, set, f);
  return transposed ? ops::fp8_transpose(q) : q;
}

void Fp8Linear::forward(const Tensor& x, const Tensor& w, Tensor& y, int64_t set) const {
  ops::fp8_gemm(activation_operand(x, kInput, set, false), weight_operand(w, set, false), y);
}

void Fp8Linear::dgrad(const Tensor& dy, const Tensor& w, Tensor& dx, float beta, int64_t set) const {
  ops::fp8_gemm(activation_operand(dy, kGrad, set, false), weight_operand(w, set, true), dx, beta);
}

std::vector<ops::Fp8Tensor> Fp8Linear::expert_weight_operands(const Tensor& w) const {
  std::vector<ops::Fp8Tensor> out;
  if (ctx_->config().recipe != Fp8Config::Recipe::Blockwise || (gathered_ && gathered_->valid) ||
      out_ % ops::kFp8BlockSize != 0 || w.ndim() != 3 || w.size(1) != out_ || w.size(2) != in_ || !w.is_contiguous())
    return out;
  const int64_t sets = w.size(0), row_blocks = out_ / ops::kFp8BlockSize;
  const ops::Fp8Tensor all = ops::quantize_blocks(w.view({sets * out_, in_}), Fp8Format::E4M3);
  for (int64_t i = 0; i < sets; ++i) {
    const ops::Fp8Tensor q{all.data.slice(0, i * out_, (i + 1) * out_),
                           all.scale_inv.slice(0, i * row_blocks, (i + 1) * row_blocks), ops::Fp8Scaling::Block128};
    out.push_back(q);
  }
  return out;
}

void Fp8Linear::forward(const Tensor& x, const ops::Fp8Tensor& w, Tensor& y, int64_t set) const {
  ops::fp8_gemm(activation_operand(x, kInput, set, false), w, y);
}

void Fp8Linear::dgrad(const Tensor& dy, const ops::Fp8Tensor& w_transposed, Tensor& dx, float beta, int64_t set) const {
  ops::fp8_gemm(activation_operand(dy, kGrad, set, false), w_transposed, dx, beta);
}

void Fp8Linear::wgrad(const Tensor& dy, const Tensor& x, Tensor& dw, float beta, int64_t set) const {
  ops::fp8_gemm(activation_operand(dy, kGrad, set, true), activation_operand(x, kInput, set, true), dw, beta);
}

}  // namespace moecore
