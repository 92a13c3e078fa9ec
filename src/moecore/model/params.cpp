#include "moecore/model/params.h"

#include <cstring>

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
  p->full_rows = shape.empty() ? 0 : shape[0];
  params_.push_back(std::move(p));
  return *params_.back();
}

Shape Param::full_shape() const {
  Shape s = shape;
  s[0] = full_rows;
  if (etp_size > 1) s[static_cast<size_t>(etp_dim)] *= etp_size;
  return s;
}

namespace {
// The full index along the split dimension of local index i of part r.
int64_t etp_full_index(const Param& p, int64_t i, int64_t local_n) {
  if (!p.etp_glu) return p.etp_rank * local_n + i;
  const int64_t half = local_n / 2, full_half = half * p.etp_size;
  return i < half ? p.etp_rank * half + i : full_half + p.etp_rank * half + (i - half);
}

// Copies between a part [L, N, K] and the full [L, N_full, K_full] on the host; to_full picks
// the direction. Elements are moved as bytes (any dtype).
void etp_copy(const Param& p, Tensor& part, Tensor& full, bool to_full) {
  const int64_t l = part.size(0), n = part.size(1), k = part.size(2), fn = full.size(1), fk = full.size(2);
  const size_t es = dtype_size(part.dtype());
  auto* pp = static_cast<uint8_t*>(part.data_ptr());
  auto* fp = static_cast<uint8_t*>(full.data_ptr());
  for (int64_t e = 0; e < l; ++e)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t fi = p.etp_dim == 1 ? etp_full_index(p, i, n) : i;
      const int64_t fc0 = p.etp_dim == 2 ? p.etp_rank * k : 0;
      uint8_t* a = pp + ((e * n + i) * k) * es;
      uint8_t* b = fp + ((e * fn + fi) * fk + fc0) * es;
      if (to_full) {
        std::memcpy(b, a, static_cast<size_t>(k) * es);
      } else {
        std::memcpy(a, b, static_cast<size_t>(k) * es);
      }
    }
}
}  // namespace

Tensor etp_take(const Param& p, const Tensor& t) {
  MC_CHECK(t.ndim() == 3 && t.size(0) == p.shape[0], "etp_take: '", p.name, "' expects [", p.shape[0],
           ", N, K], got ", t.describe());
  Tensor full = t.to(Device::cpu()).contiguous();
  Tensor part = Tensor::empty(p.shape, t.dtype(), Device::cpu());
  etp_copy(p, part, full, false);
  return part;
}

Tensor etp_assemble(const Param& p, const Tensor& parts) {
  MC_CHECK(parts.ndim() == 3 && parts.size(0) == p.shape[0] * p.etp_size, "etp_assemble: '", p.name, "' expects [",
           p.shape[0] * p.etp_size, ", N, K], got ", parts.describe());
  const Tensor host = parts.to(Device::cpu()).contiguous();
  Shape fs = p.shape;
  fs[static_cast<size_t>(p.etp_dim)] *= p.etp_size;
  Tensor full = Tensor::empty(fs, parts.dtype(), Device::cpu());
  Param q = p;  // walk the parts, each with its own rank
  for (int64_t r = 0; r < p.etp_size; ++r) {
    q.etp_rank = r;
    Tensor part = host.slice(0, r * p.shape[0], (r + 1) * p.shape[0]).contiguous();
    etp_copy(q, part, full, true);
  }
  return full;
}

Param& ParamStore::add_expert(const std::string& name, const Shape& local_shape, int64_t full_rows,
                              int64_t row_offset, double std, int64_t etp_size, int64_t etp_rank, int64_t etp_dim,
                              bool etp_glu) {
  MC_CHECK(row_offset >= 0 && row_offset + local_shape[0] <= full_rows, "expert parameter '", name, "': rows [",
           row_offset, ", ", row_offset + local_shape[0], ") are outside [0, ", full_rows, ")");
  MC_CHECK(etp_size == 1 || (local_shape.size() == 3 && (etp_dim == 1 || etp_dim == 2) && etp_rank >= 0 &&
                             etp_rank < etp_size && (!etp_glu || local_shape[1] % 2 == 0)),
           "expert parameter '", name, "': bad expert-tensor-parallel part ", etp_rank, " of ", etp_size, " along dim ",
           etp_dim);
  Param& p = add(name, local_shape, Init::Normal, std, true);
  p.expert = true;
  p.full_rows = full_rows;
  p.row_offset = row_offset;
  p.etp_size = etp_size;
  p.etp_rank = etp_rank;
  p.etp_dim = etp_dim;
  p.etp_glu = etp_glu;
  return p;
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
  p->full_rows = shape.empty() ? 0 : shape[0];
  params_.push_back(std::move(p));
  return *params_.back();
}

Param& ParamStore::get(const std::string& name) {
  for (auto& p : params_)
    if (p->name == name) return *p;
  MC_FAIL("no parameter named '", name, "'");
}

void ParamStore::initialize(int64_t dense_shard_multiple, int64_t expert_shard_multiple) {
  if (!grad_buffer_.defined()) {
    constexpr int64_t kAlign = 64;
    auto padded = [](int64_t n, int64_t unit) { return (n + unit - 1) / unit * unit; };
    grad_offsets_.assign(params_.size(), -1);
    for (bool expert : {false, true}) {
      int64_t total = 0;
      for (size_t i = 0; i < params_.size(); ++i)
        if (params_[i]->trainable && params_[i]->expert == expert) {
          grad_offsets_[i] = total;
          total += padded(params_[i]->master.numel(), kAlign);
        }
      total = padded(total, kAlign * (expert ? expert_shard_multiple : dense_shard_multiple));
      Tensor& grads = expert ? expert_grad_buffer_ : grad_buffer_;
      Tensor& masters = expert ? expert_master_buffer_ : master_buffer_;
      grads = Tensor::zeros({total}, master_, device_);
      masters = Tensor::zeros({total}, master_, device_);
      for (size_t i = 0; i < params_.size(); ++i) {
        Param& p = *params_[i];
        if (!p.trainable || p.expert != expert) continue;
        const int64_t begin = grad_offsets_[i], end = begin + p.master.numel();
        p.grad = grads.slice(0, begin, end).view(p.shape);
        const bool aliased = p.weight.data_ptr() == p.master.data_ptr();
        p.master = masters.slice(0, begin, end).view(p.shape);
        if (aliased) p.weight = p.master;
      }
    }
  }
  for (auto& p : params_) {
    switch (p->init) {
      case Init::Normal: {
        // Global element index of this rank's first element: any expert layout draws the same values.
        if (p->etp_size > 1) {  // draw this rank's experts whole, keep this part
          Shape local_full = p->full_shape();
          local_full[0] = p->shape[0];
          Tensor full = Tensor::empty(local_full, master_, device_);
          const int64_t per_expert = full.numel() / p->shape[0];
          ops::fill_normal(full, seed_, rng_key(p->name), 0.0, p->std, p->row_offset * per_expert);
          p->master.copy_from(etp_take(*p, full).to(device_));
          break;
        }
        const int64_t offset = p->shape.empty() ? 0 : p->row_offset * (p->master.numel() / p->shape[0]);
        ops::fill_normal(p->master, seed_, rng_key(p->name), 0.0, p->std, offset);
        break;
      }
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

int64_t ParamStore::grad_offset(const Param& p) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].get() == &p) {
      MC_CHECK(i < grad_offsets_.size() && grad_offsets_[i] >= 0, "parameter '", p.name, "' has no gradient buffer slot");
      return grad_offsets_[i];
    }
  MC_FAIL("parameter '", p.name, "' is not in this store");
}

void ParamStore::zero_grad() {
  if (grad_buffer_.defined()) {
    if (grad_buffer_.numel() > 0) ops::fill(grad_buffer_, 0.0);
    if (expert_grad_buffer_.numel() > 0) ops::fill(expert_grad_buffer_, 0.0);
    return;
  }
  for (auto& p : params_)
    if (p->trainable) ops::fill(p->grad, 0.0);
}

void ParamStore::refresh_compute_weights() {
  for (auto& p : params_)
    if (p->master.defined() && p->weight.data_ptr() != p->master.data_ptr()) ops::cast(p->master, p->weight);
}

int64_t ParamStore::num_elements(bool trainable_only) const {
  int64_t n = 0;
  for (const auto& p : params_)
    if (p->trainable || !trainable_only) n += p->weight.numel();
  return n;
}

}  // namespace moecore
