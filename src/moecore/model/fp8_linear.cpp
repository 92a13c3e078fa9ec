#include "moecore/model/fp8_linear.h"

#include <algorithm>
#include <cmath>

namespace moecore {

namespace {
using ops::Fp8Format;
using ops::Fp8Tensor;

float max_nan(float a, float b) { return std::isnan(a) || std::isnan(b) ? a + b : std::max(a, b); }

// Transformer Engine's delayed-scaling update of one tensor's history h [len] and scale.
void update_delayed(float* h, int64_t len, float& scale, float fp8_max, const Fp8Config& cfg) {
  float amax = h[0];
  if (cfg.amax_compute_max)
    for (int64_t i = 1; i < len; ++i) amax = max_nan(amax, h[i]);
  const float prev = scale == 0.0f ? 1.0f : scale;
  const float sf = fp8_max / amax / std::ldexp(1.0f, static_cast<int>(cfg.margin));
  scale = amax > 0.0f && std::isfinite(amax) ? sf : prev;
  std::rotate(h, h + 1, h + len);  // torch.roll(h, -1): h[i] = h[i + 1], the newest to the end
  h[0] = 0.0f;
}
}  // namespace

bool is_fp8_scaling_state(const std::string& name) {
  auto ends = [&](const std::string& suffix) {
    return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends(".fp8_amax_history") || ends(".fp8_scale");
}

void Fp8Context::finish_step(comm::Communicator* tp, comm::Communicator* dp_cp) {
  if (cfg_.recipe != Fp8Config::Recipe::Delayed || states_.empty()) return;
  const int64_t len = cfg_.amax_history_len;
  std::vector<float> newest;
  for (const State& s : states_) {
    const float* h = s.history->master.data<float>();
    for (int64_t r = 0; r < s.history->master.size(0); ++r) newest.push_back(h[r * len]);
  }
  Tensor t = Tensor::from_vector(newest, {static_cast<int64_t>(newest.size())});
  if (tp && tp->size() > 1) tp->all_reduce(t, comm::ReduceOp::Max);
  if (dp_cp && dp_cp->size() > 1) dp_cp->all_reduce(t, comm::ReduceOp::Max);
  const float* reduced = t.data<float>();
  const float e4m3 = ops::fp8_max(Fp8Format::E4M3), grad = ops::fp8_max(cfg_.hybrid ? Fp8Format::E5M2 : Fp8Format::E4M3);
  size_t i = 0;
  for (const State& s : states_) {
    float* h = s.history->master.data<float>();
    float* sc = s.scale->master.data<float>();
    for (int64_t r = 0; r < s.history->master.size(0); ++r, ++i) {
      h[r * len] = reduced[i];
      update_delayed(h + r * len, len, sc[r], r % 3 == 2 ? grad : e4m3, cfg_);
    }
  }
}

Fp8Linear::Fp8Linear(Fp8Context& ctx, ParamStore& store, const std::string& name, int64_t sets,
                     comm::Communicator* amax_group)
    : ctx_(&ctx), amax_group_(amax_group) {
  if (ctx.config().recipe != Fp8Config::Recipe::Delayed) return;
  history_ = &store.add_buffer(name + ".fp8_amax_history", {3 * sets, ctx.config().amax_history_len});
  scale_ = &store.add_buffer(name + ".fp8_scale", {3 * sets});
  ctx.add_state(history_, scale_);
}

Fp8Format Fp8Linear::grad_format() const { return ctx_->config().hybrid ? Fp8Format::E5M2 : Fp8Format::E4M3; }

float Fp8Linear::tensor_scale(const Tensor& t, Role role, int64_t set, Fp8Format f) const {
  if (ctx_->config().recipe == Fp8Config::Recipe::Tensorwise) {
    float a = ops::amax(t);
    if (amax_group_ && amax_group_->size() > 1) {
      Tensor m = Tensor::from_vector(std::vector<float>{a}, {1}, t.device());
      amax_group_->all_reduce(m, comm::ReduceOp::Max);
      a = m.data<float>()[0];
    }
    return ops::fp8_scale_from_amax(a, f, false);
  }
  const int64_t row = 3 * set + role;
  if (ctx_->recording()) {
    float& newest = history_->master.data<float>()[row * ctx_->config().amax_history_len];
    newest = max_nan(newest, ops::amax(t));
  }
  const float s = scale_->master.data<float>()[row];
  return s == 0.0f ? 1.0f : s;
}

Fp8Tensor Fp8Linear::weight_operand(const Tensor& w, int64_t set, bool transposed) const {
  Fp8Tensor q = ctx_->config().recipe == Fp8Config::Recipe::Blockwise
                    ? ops::quantize_blocks(w, Fp8Format::E4M3)
                    : ops::quantize_per_tensor(w, tensor_scale(w, kWeight, set, Fp8Format::E4M3), Fp8Format::E4M3);
  return transposed ? ops::fp8_transpose(q) : q;
}

Fp8Tensor Fp8Linear::activation_operand(const Tensor& t, Role role, int64_t set, bool transposed) const {
  const Fp8Format f = role == kGrad ? grad_format() : Fp8Format::E4M3;
  if (ctx_->config().recipe == Fp8Config::Recipe::Blockwise) return ops::quantize_tiles(t, f, transposed);
  Fp8Tensor q = ops::quantize_per_tensor(t, tensor_scale(t, role, set, f), f);
  return transposed ? ops::fp8_transpose(q) : q;
}

void Fp8Linear::forward(const Tensor& x, const Tensor& w, Tensor& y, int64_t set) const {
  ops::fp8_gemm(activation_operand(x, kInput, set, false), weight_operand(w, set, false), y);
}

void Fp8Linear::dgrad(const Tensor& dy, const Tensor& w, Tensor& dx, float beta, int64_t set) const {
  ops::fp8_gemm(activation_operand(dy, kGrad, set, false), weight_operand(w, set, true), dx, beta);
}

void Fp8Linear::wgrad(const Tensor& dy, const Tensor& x, Tensor& dw, float beta, int64_t set) const {
  ops::fp8_gemm(activation_operand(dy, kGrad, set, true), activation_operand(x, kInput, set, true), dw, beta);
}

}  // namespace moecore
