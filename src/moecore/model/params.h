// Named parameters with fp32 master weights, compute copies, gradients and AdamW state.
//
// Every parameter has a Megatron-style name ("decoder.layers.3.mlp.experts.linear_fc1.weight")
// and is initialised from Philox keyed by (seed, name, global element index), so any later
// sharded layout draws the same values. `master` holds the optimizer's copy (f32, or f64 for
// gradient checks); `weight` is what the forward reads: the master itself when the dtypes match,
// else a copy in the compute dtype (bf16 on GPU) refreshed after every optimizer step; `grad`
// accumulates in the master dtype over micro-batches. Buffers (the router's expert bias) are
// parameters without gradients or optimizer state, saved with the checkpoint.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore {

enum class Init { Normal, Zeros, Ones };

struct Param {
  std::string name;
  Shape shape;
  Init init = Init::Normal;
  double std = 0.02;
  bool weight_decay = true;
  bool trainable = true;  // false: a buffer
  DType compute_dtype = DType::F32;
  Tensor master, weight, grad, exp_avg, exp_avg_sq;
};

class ParamStore {
 public:
  ParamStore(Device device, DType master_dtype, DType compute_dtype, uint64_t seed);

  // Registers a parameter; compute_dtype defaults to the store's (the router asks for fp32).
  Param& add(const std::string& name, const Shape& shape, Init init, double std, bool weight_decay,
             DType compute_dtype = DType::F32, bool use_store_compute = true);
  Param& add_buffer(const std::string& name, const Shape& shape);
  Param& get(const std::string& name);
  const std::vector<std::unique_ptr<Param>>& all() const { return params_; }

  // Draws every parameter from Philox and zeroes gradients and optimizer state. Also moves every
  // gradient into one flat buffer (each parameter's grad becomes a view of it, at an offset
  // rounded up to 64 elements = 256 bytes for the GEMMs' alignment): zeroing is one fill and a
  // data-parallel reduction is one all-reduce.
  void initialize();
  // The flat gradient buffer (defined after initialize()); padding elements stay zero.
  Tensor& grad_buffer() { return grad_buffer_; }
  void zero_grad();
  // weight = cast(master) where they differ (after the optimizer step or a checkpoint load).
  void refresh_compute_weights();
  int64_t num_elements(bool trainable_only = true) const;

  Device device() const { return device_; }
  DType master_dtype() const { return master_; }
  DType compute_dtype() const { return compute_; }

 private:
  Device device_;
  DType master_, compute_;
  uint64_t seed_;
  std::vector<std::unique_ptr<Param>> params_;
  Tensor grad_buffer_;
};

}  // namespace moecore
