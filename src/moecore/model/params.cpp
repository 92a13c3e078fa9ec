#include "moecore/model/params.h"

#include <cstring>

#include "moecore/core/memory_categories.h"
#include "moecore/core/philox.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/master_split.h"
#include "moecore/ops/random.h"

namespace moecore {

ParamStore::ParamStore(Device device, DType master_dtype, DType compute_dtype, uint64_t seed)
    : device_(device), master_(master_dtype), compute_(compute_dtype), exp_avg_(master_dtype),
      exp_avg_sq_(master_dtype), seed_(seed) {}

void ParamStore::set_optimizer_state_dtypes(DType exp_avg, DType exp_avg_sq) {
  for (DType d : {exp_avg, exp_avg_sq})
    MC_CHECK(d == master_ || (d == DType::BF16 && master_ == DType::F32), "optimizer state dtype ", dtype_name(d),
             ": expected the master dtype (", dtype_name(master_), ") or bf16 with f32 masters");
  exp_avg_ = exp_avg;
  exp_avg_sq_ = exp_avg_sq;
  const MemoryCategoryScope scope(MemoryCategory::kOptimizerState);
  for (const auto& p : params_) {
    if (!p->exp_avg.defined()) continue;  // buffers, or states the distributed optimizer released
    p->exp_avg = Tensor::zeros(p->shape, exp_avg_, device_);
    p->exp_avg_sq = Tensor::zeros(p->shape, exp_avg_sq_, device_);
  }
}

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
  p->full_rows = shape.empty() ? 0 : shape[0];
  if (shapes_only_) {
    params_.push_back(std::move(p));
    return *params_.back();
  }
  {
    const MemoryCategoryScope scope(MemoryCategory::kWeights);
    p->master = Tensor::empty(shape, master_, device_);
    p->weight = p->compute_dtype == master_ ? p->master : Tensor::empty(shape, p->compute_dtype, device_);
  }
  {
    const MemoryCategoryScope scope(MemoryCategory::kGradients);
    p->grad = Tensor::zeros(shape, master_, device_);
  }
  const MemoryCategoryScope scope(MemoryCategory::kOptimizerState);
  p->exp_avg = Tensor::zeros(shape, exp_avg_, device_);
  p->exp_avg_sq = Tensor::zeros(shape, exp_avg_sq_, device_);
  params_.push_back(std::move(p));
  return *params_.back();
}

Shape Param::full_shape() const {
  Shape s = shape;
  s[0] = full_rows;
  if (part_size > 1) s[static_cast<size_t>(part_dim)] *= part_size;
  return s;
}

namespace {
// A part viewed as [L, N, K] with the split along dimension 1 (rows) or 2 (columns) of that view:
// experts [E, N, K] as they are, dense [N, K] as [1, N, K], dense [N] as [1, N, 1].
struct PartView {
  Shape shape3;  // of the part
  int64_t dim3 = 1;
};
PartView part_view(const Param& p) {
  const Shape& s = p.shape;
  if (s.size() == 3) return {s, p.part_dim};
  if (s.size() == 2) return {{1, s[0], s[1]}, p.part_dim + 1};
  return {{1, s[0], 1}, 1};
}

// The full index along the split dimension of local index i of part r.
int64_t part_full_index(const Param& p, int64_t i, int64_t local_n) {
  if (!p.part_glu) return p.part_rank * local_n + i;
  const int64_t half = local_n / 2, full_half = half * p.part_size;
  return i < half ? p.part_rank * half + i : full_half + p.part_rank * half + (i - half);
}

// Copies between a part [L, N, K] and the full [L, N_full, K_full] (3-D views) on the host; to_full
// picks the direction. Elements are moved as bytes (any dtype).
void part_copy(const Param& p, int64_t dim3, Tensor& part, Tensor& full, bool to_full) {
  const int64_t l = part.size(0), n = part.size(1), k = part.size(2), fn = full.size(1), fk = full.size(2);
  const size_t es = dtype_size(part.dtype());
  auto* pp = static_cast<uint8_t*>(part.data_ptr());
  auto* fp = static_cast<uint8_t*>(full.data_ptr());
  for (int64_t e = 0; e < l; ++e)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t fi = dim3 == 1 ? part_full_index(p, i, n) : i;
      const int64_t fc0 = dim3 == 2 ? p.part_rank * k : 0;
      uint8_t* a = pp + ((e * n + i) * k) * es;
      uint8_t* b = fp + ((e * fn + fi) * fk + fc0) * es;
      if (to_full) {
        std::memcpy(b, a, static_cast<size_t>(k) * es);
      } else {
        std::memcpy(a, b, static_cast<size_t>(k) * es);
      }
    }
}

Shape whole_local(const Param& p) {  // p's shape with the split dimension whole
  Shape s = p.shape;
  s[static_cast<size_t>(p.part_dim)] *= p.part_size;
  return s;
}
}  // namespace

Tensor part_take(const Param& p, const Tensor& t) {
  MC_CHECK(t.shape() == whole_local(p), "part_take: '", p.name, "' expects ", shape_str(whole_local(p)), ", got ",
           t.describe());
  const PartView v = part_view(p);
  Shape full3 = v.shape3;
  full3[static_cast<size_t>(v.dim3)] *= p.part_size;
  Tensor full = t.to(Device::cpu()).contiguous().view(full3);
  Tensor part = Tensor::empty(v.shape3, t.dtype(), Device::cpu());
  part_copy(p, v.dim3, part, full, false);
  return part.view(p.shape);
}

Tensor part_assemble(const Param& p, const Tensor& parts) {
  MC_CHECK(parts.numel() == shape_numel(p.shape) * p.part_size, "part_assemble: '", p.name, "' expects ", p.part_size,
           " parts of ", shape_str(p.shape), ", got ", parts.describe());
  const Tensor host = parts.to(Device::cpu()).contiguous();
  const PartView v = part_view(p);
  Shape full3 = v.shape3;
  full3[static_cast<size_t>(v.dim3)] *= p.part_size;
  Tensor full = Tensor::empty(full3, parts.dtype(), Device::cpu());
  const int64_t per_part = shape_numel(p.shape);
  Param q = p;  // walk the parts, each with its own rank
  for (int64_t r = 0; r < p.part_size; ++r) {
    q.part_rank = r;
    Tensor part = host.view({parts.numel()}).slice(0, r * per_part, (r + 1) * per_part).contiguous().view(v.shape3);
    part_copy(q, v.dim3, part, full, true);
  }
  return full.view(whole_local(p));
}

Param& ParamStore::add_expert(const std::string& name, const Shape& local_shape, int64_t full_rows,
                              int64_t row_offset, double std, int64_t part_size, int64_t part_rank, int64_t part_dim,
                              bool part_glu) {
  MC_CHECK(row_offset >= 0 && row_offset + local_shape[0] <= full_rows, "expert parameter '", name, "': rows [",
           row_offset, ", ", row_offset + local_shape[0], ") are outside [0, ", full_rows, ")");
  MC_CHECK(part_size == 1 || (local_shape.size() == 3 && (part_dim == 1 || part_dim == 2) && part_rank >= 0 &&
                             part_rank < part_size && (!part_glu || local_shape[1] % 2 == 0)),
           "expert parameter '", name, "': bad expert-tensor-parallel part ", part_rank, " of ", part_size, " along dim ",
           part_dim);
  Param& p = add(name, local_shape, Init::Normal, std, true);
  p.expert = true;
  p.full_rows = full_rows;
  p.row_offset = row_offset;
  p.part_size = part_size;
  p.part_rank = part_rank;
  p.part_dim = part_dim;
  p.part_glu = part_glu;
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
  p->full_rows = shape.empty() ? 0 : shape[0];
  if (!shapes_only_) {
    const MemoryCategoryScope scope(MemoryCategory::kWeights);
    p->master = Tensor::zeros(shape, master_, device_);
    p->weight = p->master;
  }
  params_.push_back(std::move(p));
  return *params_.back();
}

Param& ParamStore::get(const std::string& name) {
  for (auto& p : params_)
    if (p->name == name) return *p;
  MC_FAIL("no parameter named '", name, "'");
}

void ParamStore::set_shapes_only(bool on) {
  MC_CHECK(params_.empty(), "set_shapes_only: call before the first parameter is registered");
  shapes_only_ = on;
}

void ParamStore::initialize(int64_t dense_shard_multiple, int64_t expert_shard_multiple) {
  MC_CHECK(!shapes_only_, "initialize: this parameter store records shapes only (it has no tensors)");
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
      {
        const MemoryCategoryScope scope(MemoryCategory::kGradients);
        grads = Tensor::zeros({total}, master_, device_);
      }
      const MemoryCategoryScope scope(MemoryCategory::kWeights);
      Tensor& masters = expert ? expert_master_buffer_ : master_buffer_;
      if (remainders_) {  // the halves instead of fp32 masters (no flat master buffer)
        high_buffer(expert) = Tensor::zeros({total}, DType::BF16, device_);
        remainder_buffer(expert) = Tensor::zeros({total}, DType::I16, device_);
        masters = Tensor::zeros({0}, master_, device_);
      } else {
        masters = Tensor::zeros({total}, master_, device_);
      }
      for (size_t i = 0; i < params_.size(); ++i) {
        Param& p = *params_[i];
        if (!p.trainable || p.expert != expert) continue;
        const int64_t begin = grad_offsets_[i], end = begin + p.master.numel();
        p.grad = grads.slice(0, begin, end).view(p.shape);
        const bool aliased = p.weight.data_ptr() == p.master.data_ptr();
        if (remainders_) {
          p.high = high_buffer(expert).slice(0, begin, end).view(p.shape);
          p.remainder = remainder_buffer(expert).slice(0, begin, end).view(p.shape);
          if (p.compute_dtype == DType::BF16) p.weight = p.high;
          p.master = Tensor();
          continue;
        }
        p.master = masters.slice(0, begin, end).view(p.shape);
        if (aliased) p.weight = p.master;
      }
    }
  }
  for (auto& p : params_) {
    // Split masters: drawn in f32, then split into the halves.
    Tensor master = p->master.defined() ? p->master : Tensor::empty(p->shape, master_, device_);
    switch (p->init) {
      case Init::Normal: {
        // Global element index of this rank's first element: any expert layout draws the same values.
        if (p->part_size > 1) {  // draw this rank's rows whole (its experts, or all), keep this part
          Shape local_full = p->shape;
          local_full[static_cast<size_t>(p->part_dim)] *= p->part_size;
          Tensor full = Tensor::empty(local_full, master_, device_);
          const int64_t per_expert = full.numel() / full.size(0);  // row_offset > 0 only for experts (dim 0 whole)
          ops::fill_normal(full, seed_, rng_key(p->name), 0.0, p->std, p->row_offset * per_expert);
          master.copy_from(part_take(*p, full).to(device_));
          break;
        }
        const int64_t offset = p->shape.empty() ? 0 : p->row_offset * (master.numel() / p->shape[0]);
        ops::fill_normal(master, seed_, rng_key(p->name), 0.0, p->std, offset);
        break;
      }
      case Init::Zeros: ops::fill(master, 0.0); break;
      case Init::Ones: ops::fill(master, 1.0); break;
    }
    if (!p->master.defined()) ops::split_master(master, p->high, p->remainder);
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

bool Param::grad_accumulates() {
  const bool stale = grad_stale;
  grad_stale = false;
  return !stale;
}

Tensor& Param::grad_to_accumulate() {
  if (grad_stale) {
    ops::fill(grad, 0.0);
    grad_stale = false;
  }
  return grad;
}

void ParamStore::mark_grads_stale() {
  for (auto& p : params_)
    if (p->trainable) p->grad_stale = true;
}

void ParamStore::zero_stale_grads() {
  for (auto& p : params_)
    if (p->trainable) (void)p->grad_to_accumulate();
}

void ParamStore::zero_stale_grads(bool expert, int64_t begin, int64_t end) {
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = *params_[i];
    if (!p.trainable || !p.grad_stale || p.expert != expert) continue;
    MC_CHECK(i < grad_offsets_.size() && grad_offsets_[i] >= 0, "zero_stale_grads: parameter '", p.name,
             "' has no gradient buffer slot");
    const int64_t lo = grad_offsets_[i], hi = lo + p.grad.numel();
    if (lo < end && hi > begin) (void)p.grad_to_accumulate();  // overlaps the range
  }
}

void ParamStore::zero_grad() {
  for (auto& p : params_) p->grad_stale = false;
  if (grad_buffer_.defined()) {
    if (grad_buffer_.numel() > 0) ops::fill(grad_buffer_, 0.0);
    if (expert_grad_buffer_.numel() > 0) ops::fill(expert_grad_buffer_, 0.0);
    return;
  }
  for (auto& p : params_)
    if (p->trainable) ops::fill(p->grad, 0.0);
}

void ParamStore::refresh_compute_weights(const std::function<bool(const Param&)>& done) {
  for (auto& p : params_) {
    if (p->master.defined() && p->weight.data_ptr() != p->master.data_ptr() && !(done && done(*p)))
      ops::cast(p->master, p->weight);
    if (!p->master.defined() && p->remainder.defined() && p->weight.data_ptr() != p->high.data_ptr()) {
      // The router's fp32 (or, on the CPU, fp64) weight: the joined master.
      if (p->weight.dtype() == DType::F32) {
        ops::join_master(p->high, p->remainder, p->weight);
      } else {
        ops::assign_cast(master_value(*p), p->weight);
      }
    }
  }
}

void ParamStore::store_param_remainders(bool on) {
  MC_CHECK(!grad_buffer_.defined(), "store_param_remainders: call before initialize()");
  MC_CHECK(!on || (master_ == DType::F32 && compute_ == DType::BF16), "split masters (stored param remainders) need ",
           "bf16 compute with f32 masters; this store has ", dtype_name(master_), " masters and ", dtype_name(compute_),
           " compute");
  remainders_ = on;
}

void ParamStore::release_remainder_buffers() {
  remainder_buffer_ = expert_remainder_buffer_ = Tensor();
  for (auto& p : params_) p->remainder = Tensor();
}

Tensor ParamStore::master_value(const Param& p) const {
  if (p.master.defined()) return p.master;
  MC_CHECK(p.remainder.defined(), "parameter '", p.name, "' has no master here (the distributed optimizer's shards ",
           "hold it)");
  Tensor out = Tensor::empty(p.shape, master_, device_);
  ops::join_master(p.high, p.remainder, out);
  return out;
}

void ParamStore::set_master(Param& p, const Tensor& values) {
  if (p.master.defined()) {
    p.master.copy_from(values);
    return;
  }
  MC_CHECK(p.remainder.defined(), "parameter '", p.name, "' has no master here (the distributed optimizer's shards ",
           "hold it)");
  ops::split_master(values.to(device_).contiguous(), p.high, p.remainder);
}

int64_t ParamStore::num_elements(bool trainable_only) const {
  int64_t n = 0;
  for (const auto& p : params_)
    if (p->trainable || !trainable_only) n += shape_numel(p->shape);
  return n;
}

}  // namespace moecore
