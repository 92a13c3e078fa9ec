#include "moecore/model/params.h"

#include "moecore/core/philox.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/random.h"

namespace moecore {

ParamStore::ParamStore(Device device, DType master_dtype, DType compute_dtype, uint64_t seed)
    : device_(device), master_(master_dtype), compute_(compute_dtype), seed_(seed) {}

Param& ParamStore::add(const std::string& name, const Shape& shape, Init init, double std, bool weight_decay,
                       DType compute_dtype, bool use_store_compute) {
  for (const auto& p : params_) MC_CHECK(p->name != name, "parameter '", name, "' registered twice");
  auto p = std::make_unique<Param>();
  p->name = name;
  p->shape = shape;
  p->init = init;
  p->std = std;
  p->weight_decay = weight_decay;
  // f64 masters (gradient checks) compute in f64 everywhere.
  p->compute_dtype = master_ == DType::F64 ? DType::F64 : (use_store_compute ? compute_ : compute_dtype);
  p->master = Tensor::empty(shape, master_, device_);
  p->weight = p->compute_dtype == master_ ? p->master : Tensor::empty(shape, p->compute_dtype, device_);
  p->grad = Tensor::zeros(shape, master_, device_);
  p->exp_avg = Tensor::zeros(shape, master_, device_);
  p->exp_avg_sq = Tensor::zeros(shape, master_, device_);
  params_.push_back(std::move(p));
  return *params_.back();
}

Param& ParamStore::add_buffer(const std::string& name, const Shape& shape) {
  for (const auto& p : params_) MC_CHECK(p->name != name, "buffer '", name, "' registered twice");
  auto p = std::make_unique<Param>();
  p->name = name;
  p->shape = shape;
  p->init = Init::Zeros;
  p->trainable = false;
  p->weight_decay = false;
  p->compute_dtype = master_;
  p->master = Tensor::zeros(shape, master_, device_);
  p->weight = p->master;
  params_.push_back(std::move(p));
  return *params_.back();
}

Param& ParamStore::get(const std::string& name) {
  for (auto& p : params_)
    if (p->name == name) return *p;
  MC_FAIL("no parameter named '", name, "'");
}

void ParamStore::initialize() {
  if (!grad_buffer_.defined()) {
    constexpr int64_t kAlign = 64;
    int64_t total = 0;
    for (const auto& p : params_)
      if (p->trainable) total += (p->master.numel() + kAlign - 1) / kAlign * kAlign;
    grad_buffer_ = Tensor::zeros({total}, master_, device_);
    int64_t offset = 0;
    for (auto& p : params_) {
      if (!p->trainable) continue;
      const int64_t n = p->master.numel();
      p->grad = grad_buffer_.slice(0, offset, offset + n).view(p->shape);
      offset += (n + kAlign - 1) / kAlign * kAlign;
    }
  }
  for (auto& p : params_) {
    switch (p->init) {
      case Init::Normal: ops::fill_normal(p->master, seed_, rng_key(p->name), 0.0, p->std); break;
      case Init::Zeros: ops::fill(p->master, 0.0); break;
      case Init::Ones: ops::fill(p->master, 1.0); break;
    }
    if (p->trainable) {
      ops::fill(p->exp_avg, 0.0);
      ops::fill(p->exp_avg_sq, 0.0);
    }
  }
  zero_grad();
  refresh_compute_weights();
}

void ParamStore::zero_grad() {
  if (grad_buffer_.defined()) {
    ops::fill(grad_buffer_, 0.0);
    return;
  }
  for (auto& p : params_)
    if (p->trainable) ops::fill(p->grad, 0.0);
}

void ParamStore::refresh_compute_weights() {
  for (auto& p : params_)
    if (p->weight.data_ptr() != p->master.data_ptr()) ops::cast(p->master, p->weight);
}

int64_t ParamStore::num_elements(bool trainable_only) const {
  int64_t n = 0;
  for (const auto& p : params_)
    if (p->trainable || !trainable_only) n += p->master.numel();
  return n;
}

}  // namespace moecore
