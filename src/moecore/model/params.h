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

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore {

class Fp8Context;

enum class Init { Normal, Zeros, Ones };

struct Param {
  std::string name;
  Shape shape;
  Init init = Init::Normal;
  double std = 0.02;
  bool weight_decay = true;
  bool trainable = true;  // false: a buffer
  DType compute_dtype = DType::F32;
  // Expert parallelism: an expert parameter's gradient is reduced over the expert-data-parallel
  // group (not the data-parallel one). A rank holding only some experts keeps rows
  // [row_offset, row_offset + shape[0]) of a tensor of full_rows rows (dim 0 = experts); its
  // Philox draw and its checkpoint slice use those global rows.
  bool expert = false;
  int64_t row_offset = 0, full_rows = 0;  // full_rows = shape[0] unless sharded
  // Tensor-parallel part (expert tensor parallelism for experts, tensor parallelism for dense
  // parameters): this rank holds part part_rank of part_size along dimension part_dim.
  //   experts [E, N, K]: part_dim 1 splits rows (fc1), 2 columns (fc2), for each expert;
  //   dense [N, K]: part_dim 0 splits rows (column-parallel weight, vocabulary-parallel
  //   embedding), 1 columns (row-parallel weight); dense [N]: part_dim 0 (column-parallel bias).
  // part_glu: the split dimension holds two GLU halves [gate; up], each split, so the part is
  // [gate rows of part r; up rows of part r] (SwiGLU fc1).
  int64_t part_size = 1, part_rank = 0, part_dim = 0;
  bool part_glu = false;
  // A replicated dense parameter whose gradient is a partial sum on each tensor-parallel rank
  // (it sees only the rank's sequence-parallel tokens or its attention heads): summed over the
  // TP group before the data-parallel reduction (Megatron's sequence_parallel attribute).
  bool tp_partial_grad = false;
  Tensor master, weight, grad, exp_avg, exp_avg_sq;
  // Split masters (ParamStore::store_param_remainders): `master` is undefined and the fp32 master
  // is join(high, remainder) (ops/master_split.h): `high` (bf16) is the weight itself for bf16
  // compute, a separate bf16 tensor for an fp32-compute parameter (whose `weight` is then the
  // joined master, refreshed after each step). The distributed optimizer keeps `remainder` in its
  // shards only (undefined here then).
  Tensor high, remainder;
  // The gradient is stale once an optimizer step has consumed it (ParamStore::mark_grads_stale):
  // its contents are then garbage, and the step's first producer either writes it whole
  // (grad_accumulates() false: a GEMM with beta 0, a grouped wgrad that overwrites) or has it
  // zeroed first (grad_to_accumulate()). Either way it is current afterwards. Gradients no
  // producer reached are zeroed before they are read (ParamStore::zero_stale_grads). This saves
  // the zero-fill of every gradient each step and the GEMMs' read of the old values.
  bool grad_stale = false;
  // Whether the next write adds to the gradient (true) or overwrites it (stale: false).
  bool grad_accumulates();
  float grad_beta() { return grad_accumulates() ? 1.0f : 0.0f; }
  // The gradient for a producer that adds into it (scatter-adds, norms): zeroed first when stale.
  Tensor& grad_to_accumulate();

  Shape full_shape() const;
  bool sharded() const { return full_rows != shape[0] || part_size > 1; }
};

// Tensor-parallel parts (host copies; for initialisation and checkpoints):
//   part_take(p, t)      t: p's shape with the split dimension whole (full_rows of experts
//                        not included: this rank's experts) -> p's part
//   part_assemble(p, t)  t: every rank's part stacked along dimension 0 (rank-major, as
//                        all_gather returns them) -> the tensor with the split dimension whole
Tensor part_take(const Param& p, const Tensor& t);
Tensor part_assemble(const Param& p, const Tensor& parts);

class ParamStore {
 public:
  ParamStore(Device device, DType master_dtype, DType compute_dtype, uint64_t seed);

  // A store that records names, shapes and attributes only: add() and add_buffer() create no
  // tensors (every Tensor of its Params stays undefined) and initialize() refuses. The model's
  // constructors run unchanged on it, so a model of any size can be described without memory
  // (model/param_count.h). Call before the first add().
  void set_shapes_only(bool on);
  bool shapes_only() const { return shapes_only_; }

  // Registers a parameter; compute_dtype defaults to the store's (the router asks for fp32).
  Param& add(const std::string& name, const Shape& shape, Init init, double std, bool weight_decay,
             DType compute_dtype = DType::F32, bool use_store_compute = true);
  Param& add_buffer(const std::string& name, const Shape& shape);
  // An expert parameter: the rows [row_offset, row_offset + shape[0]) of a [full_rows, ...] tensor.
  Param& add_expert(const std::string& name, const Shape& local_shape, int64_t full_rows, int64_t row_offset,
                    double std, int64_t part_size = 1, int64_t part_rank = 0, int64_t part_dim = 0, bool part_glu = false);
  Param& get(const std::string& name);
  // FP8 training: the context the model's linears quantise with (model/fp8_linear.h; null: off).
  // Set before the model is built; the store does not own it.
  void set_fp8(Fp8Context* ctx) { fp8_ = ctx; }
  Fp8Context* fp8() const { return fp8_; }
  const std::vector<std::unique_ptr<Param>>& all() const { return params_; }

  // Draws every parameter from Philox and zeroes gradients and optimizer state. Also moves the
  // gradients into two flat buffers, dense parameters then expert parameters (each grad becomes
  // a view, at an offset rounded up to 64 elements = 256 bytes for the GEMMs' alignment):
  // zeroing is one fill and each data-parallel reduction works on one buffer.
  // shard_multiple: each buffer's length is rounded up to a multiple of 64 * shard_multiple[i]
  // (dense, expert), so the distributed optimizer can split it evenly over its group.
  // The fp32 masters of trainable parameters live in flat buffers of the same layout
  // (master_buffer(), expert_master_buffer()).
  void initialize(int64_t dense_shard_multiple = 1, int64_t expert_shard_multiple = 1);
  Tensor& master_buffer() { return master_buffer_; }
  Tensor& expert_master_buffer() { return expert_master_buffer_; }
  // Split masters (the default with bf16 compute and f32 masters, off with --no-store-param-remainders; call
  // before initialize()): every trainable parameter's fp32 master is kept as its bf16 high half
  // and an int16 remainder (ops/master_split.h), in two flat buffers of the gradient layout, instead
  // of a flat fp32 master buffer next to the bf16 weights: 2 bytes fewer per parameter, the same
  // fp32 values. The bf16 weights are views of the high-half buffer.
  void store_param_remainders(bool on);
  bool param_remainders() const { return remainders_; }
  Tensor& high_buffer(bool expert) { return expert ? expert_high_buffer_ : high_buffer_; }
  Tensor& remainder_buffer(bool expert) { return expert ? expert_remainder_buffer_ : remainder_buffer_; }
  // The distributed optimizer's sharded remainders: it keeps the shard it owns and drops these
  // (Param::remainder becomes undefined; the high halves stay: they are the weights).
  void release_remainder_buffers();
  // A parameter's master values in the master dtype: `master` itself, or the joined halves (a new
  // tensor). set_master writes them (`master`, or both halves); refresh_compute_weights follows.
  Tensor master_value(const Param& p) const;
  void set_master(Param& p, const Tensor& values);
  // The distributed optimizer's sharded masters: it keeps the fp32 masters of bf16-compute
  // parameters in its shards only and drops the whole-model buffers (Param::master becomes
  // undefined for those parameters; refresh_compute_weights skips them).
  void release_master_buffers() { master_buffer_ = expert_master_buffer_ = Tensor(); }
  // The flat gradient buffers (defined after initialize(); either may be empty); padding
  // elements stay zero.
  Tensor& grad_buffer() { return grad_buffer_; }
  Tensor& expert_grad_buffer() { return expert_grad_buffer_; }
  // Where a parameter's gradient lives in its buffer (elements).
  int64_t grad_offset(const Param& p) const;
  void zero_grad();
  // After an optimizer step: every trainable gradient becomes stale (Param::grad_stale) instead
  // of being zeroed; the next backward overwrites or zeroes each one as it first writes it.
  void mark_grads_stale();
  // Zeroes the stale gradients (those no producer wrote since the last step), all of them or
  // those of one buffer (expert or dense) overlapping elements [begin, end): call before reading.
  void zero_stale_grads();
  void zero_stale_grads(bool expert, int64_t begin, int64_t end);
  // weight = cast(master) where they differ (after the optimizer step or a checkpoint load),
  // except for the parameters `done` says are already fresh (the optimizer wrote them); with
  // split masters, an fp32-compute weight = join(high, remainder).
  void refresh_compute_weights(const std::function<bool(const Param&)>& done = {});
  // Elements of the registered parameters (their shapes: this rank's parts).
  int64_t num_elements(bool trainable_only = true) const;

  Device device() const { return device_; }
  DType master_dtype() const { return master_; }
  DType compute_dtype() const { return compute_; }
  // AdamW's exp_avg and exp_avg_sq dtypes (--exp-avg-dtype, --exp-avg-sq-dtype with
  // --use-precision-aware-optimizer): the master dtype (default) or bf16 with f32 masters.
  // Re-allocates the states of the parameters registered so far (zeros); later ones follow.
  void set_optimizer_state_dtypes(DType exp_avg, DType exp_avg_sq);
  DType exp_avg_dtype() const { return exp_avg_; }
  DType exp_avg_sq_dtype() const { return exp_avg_sq_; }

 private:
  Fp8Context* fp8_ = nullptr;
  Device device_;
  DType master_, compute_;
  DType exp_avg_, exp_avg_sq_;
  uint64_t seed_;
  std::vector<std::unique_ptr<Param>> params_;
  Tensor grad_buffer_, expert_grad_buffer_, master_buffer_, expert_master_buffer_;
  bool remainders_ = false;
  bool shapes_only_ = false;
  Tensor high_buffer_, expert_high_buffer_, remainder_buffer_, expert_remainder_buffer_;
  std::vector<int64_t> grad_offsets_;  // per params_ entry, -1 for buffers
};

}  // namespace moecore
