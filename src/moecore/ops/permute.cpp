#include "moecore/ops/permute.h"

#include <cmath>
#include <limits>

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace detail {
void fail_bad_expert_index(const char* op, int64_t t, int64_t j, int64_t value, int64_t num_experts) {
  MC_FAIL(op, ": indices[", t, ", ", j, "] = ", value, " is out of range [0, ", num_experts, ")");
}
void fail_over_capacity(int64_t expert, int64_t count, int64_t capacity) {
  MC_FAIL("make_moe_routing: expert ", expert, " has ", count, " kept assignments, more than pad_to_capacity = ",
          capacity, " (drop with capacity_mask first)");
}
}  // namespace detail

namespace {

constexpr int64_t kMaxI32 = std::numeric_limits<int32_t>::max();

// indices [T, k] i32, contiguous; returns nothing, raises on a bad tensor.
void check_indices(const char* op, const Tensor& indices) {
  check_contiguous(op, "indices", indices);
  check_dtype(op, "indices", indices, {DType::I32});
  MC_CHECK(indices.ndim() == 2 && indices.size(1) > 0, op, ": argument 'indices' has shape ",
           shape_str(indices.shape()), "; expected [T, k] with k > 0");
  MC_CHECK(indices.numel() <= kMaxI32, op, ": ", indices.numel(), " assignments do not fit i32 row numbers");
}

void check_float_dtype(const char* op, const char* name, const Tensor& t) {
  check_dtype(op, name, t, {DType::F32, DType::BF16, DType::F64});
  MC_CHECK(!(t.device().is_cuda() && t.dtype() == DType::F64), op, ": '", name, "' is f64, which is CPU-only");
}

void check_probs(const char* op, const char* name, const Tensor& probs, const MoeRouting& r) {
  check_contiguous(op, name, probs);
  check_dtype(op, name, probs, {DType::F32, DType::F64});
  MC_CHECK(!(probs.device().is_cuda() && probs.dtype() == DType::F64), op, ": '", name,
           "' is f64, which is CPU-only");
  check_shape(op, name, probs, {r.num_tokens, r.topk});
}

// The routing must be complete and on the device of `t`.
void check_routing(const char* op, const MoeRouting& r, const Tensor& t) {
  MC_CHECK(r.row_map.defined() && r.tokens_per_expert.defined(), op,
           ": the routing is empty (build it with make_moe_routing)");
  check_shape(op, "routing.row_map", r.row_map, {r.num_tokens, r.topk});
  check_dtype(op, "routing.row_map", r.row_map, {DType::I32});
  MC_CHECK(r.row_map.device() == t.device(), op, ": the routing is on ", r.row_map.device().str(),
           " but the tensors are on ", t.device().str());
}

// x-like tensor [rows, H] with H taken from `ref`.
void check_rows(const char* op, const char* name, const Tensor& t, int64_t rows, const Tensor& ref,
                const char* ref_name) {
  check_contiguous(op, name, t);
  check_same_device(op, t, ref);
  MC_CHECK(t.ndim() == 2, op, ": argument '", name, "' has shape ", shape_str(t.shape()), "; expected 2-D [rows, H]");
  check_shape(op, name, t, {rows, ref.size(1)});
  MC_CHECK(t.dtype() == ref.dtype(), op, ": '", name, "' is ", dtype_name(t.dtype()), " but '", ref_name, "' is ",
           dtype_name(ref.dtype()));
}

}  // namespace

int64_t expert_capacity(int64_t num_tokens, int64_t topk, int64_t num_experts, double capacity_factor) {
  MC_CHECK(num_tokens >= 0 && topk > 0 && num_experts > 0, "expert_capacity: needs num_tokens >= 0, topk > 0 and "
           "num_experts > 0; got T=", num_tokens, ", k=", topk, ", E=", num_experts);
  MC_CHECK(std::isfinite(capacity_factor) && capacity_factor > 0, "expert_capacity: capacity_factor must be > 0, got ",
           capacity_factor);
  // Megatron: math.ceil((num_tokens * topk / num_experts) * capacity_factor), evaluated in double.
  const double c = std::ceil(static_cast<double>(num_tokens * topk) / static_cast<double>(num_experts) *
                             capacity_factor);
  return c > static_cast<double>(num_tokens) ? num_tokens : static_cast<int64_t>(c);
}

void capacity_mask(const Tensor& indices, const Tensor& probs, int64_t num_experts, int64_t capacity,
                   DropPolicy policy, Tensor& kept) {
  constexpr const char* op = "capacity_mask";
  check_indices(op, indices);
  check_contiguous(op, "probs", probs);
  check_contiguous(op, "kept", kept);
  check_same_device(op, indices, probs);
  check_same_device(op, indices, kept);
  check_dtype(op, "probs", probs, {DType::F32, DType::F64});
  check_same_shape(op, "indices", indices, "probs", probs);
  check_shape(op, "kept", kept, indices.shape());
  check_dtype(op, "kept", kept, {DType::U8});
  MC_CHECK(num_experts > 0, op, ": num_experts must be > 0, got ", num_experts);
  MC_CHECK(capacity >= 0, op, ": capacity must be >= 0, got ", capacity);
  MC_CHECK(num_experts <= kMaxI32, op, ": num_experts must fit i32, got ", num_experts);
  if (indices.device().is_cpu()) {
    cpu::capacity_mask(indices, probs, num_experts, capacity, policy, kept);
    return;
  }
  MC_CHECK(probs.dtype() == DType::F32, op, ": 'probs' is f64, which is CPU-only");
  MC_CUDA_BACKEND(op, cuda::capacity_mask(indices, probs, num_experts, capacity, policy, kept));
}

MoeRouting make_moe_routing(const Tensor& indices, const Tensor& kept, int64_t num_experts, int64_t pad_to_capacity,
                            bool copy_counts) {
  constexpr const char* op = "make_moe_routing";
  check_indices(op, indices);
  if (kept.defined()) {
    check_contiguous(op, "kept", kept);
    check_same_device(op, indices, kept);
    check_dtype(op, "kept", kept, {DType::U8});
    check_shape(op, "kept", kept, indices.shape());
  }
  MC_CHECK(num_experts > 0 && num_experts <= kMaxI32, op, ": num_experts must be in [1, 2^31), got ", num_experts);
  MC_CHECK(pad_to_capacity >= 0, op, ": pad_to_capacity must be >= 0, got ", pad_to_capacity);
  MC_CHECK(pad_to_capacity == 0 || num_experts * pad_to_capacity <= kMaxI32, op, ": E * pad_to_capacity = ",
           num_experts * pad_to_capacity, " rows do not fit i32 row numbers");
  MoeRouting r;
  r.num_tokens = indices.size(0);
  r.topk = indices.size(1);
  r.num_experts = num_experts;
  r.capacity = pad_to_capacity;
  if (indices.device().is_cpu()) {
    cpu::make_moe_routing(indices, kept, r);
  } else {
    // Without the counts, num_rows is known only when nothing is dropped or every expert is padded.
    [[maybe_unused]] const bool copy = copy_counts || (kept.defined() && pad_to_capacity == 0);
    MC_CUDA_BACKEND(op, cuda::make_moe_routing(indices, kept, r, copy));
  }
  return r;
}

void accumulate_routing_counts(const MoeRouting& r, Tensor& acc) {
  constexpr const char* op = "accumulate_routing_counts";
  MC_CHECK(r.kept_per_expert.defined(), op, ": the routing is empty (build it with make_moe_routing)");
  check_contiguous(op, "acc", acc);
  check_dtype(op, "acc", acc, {DType::I64});
  check_same_device(op, r.kept_per_expert, acc);
  check_shape(op, "acc", acc, {r.num_experts + 2});
  if (acc.device().is_cpu()) {
    const int32_t* c = r.kept_per_expert.data<int32_t>();
    int64_t* a = acc.data<int64_t>();
    for (int64_t e = 0; e < r.num_experts; ++e) a[e] += c[e];  // CPU plans were checked when made
  } else {
    MC_CUDA_BACKEND(op, cuda::accumulate_routing_counts(r, acc));
  }
}

void check_moe_routing(const MoeRouting& r, const Tensor& indices) {
  if (!r.status.defined()) return;
  const std::vector<int32_t> host = r.status.to_vector<int32_t>();
  const int64_t E = r.num_experts;
  const int32_t first_bad = host[static_cast<size_t>(E)];
  if (first_bad != std::numeric_limits<int32_t>::max()) {
    MC_CHECK(indices.defined(), "make_moe_routing: indices[", first_bad / r.topk, ", ", first_bad % r.topk,
             "] is out of range [0, ", E, ")");
    const int32_t value = indices.view({-1}).slice(0, first_bad, first_bad + 1).to_vector<int32_t>()[0];
    detail::fail_bad_expert_index("make_moe_routing", first_bad / r.topk, first_bad % r.topk, value, E);
  }
  for (int64_t e = 0; e < E && r.capacity > 0; ++e)
    if (host[static_cast<size_t>(e)] > r.capacity) detail::fail_over_capacity(e, host[static_cast<size_t>(e)], r.capacity);
}

void moe_permute_forward(const Tensor& x, const MoeRouting& r, Tensor& out) {
  constexpr const char* op = "moe_permute_forward";
  check_contiguous(op, "x", x);
  check_float_dtype(op, "x", x);
  check_routing(op, r, x);
  MC_CHECK(x.ndim() == 2 && x.size(0) == r.num_tokens, op, ": argument 'x' has shape ", shape_str(x.shape()),
           "; expected [T, H] with T = ", r.num_tokens);
  check_rows(op, "out", out, r.num_rows, x, "x");
  if (x.device().is_cpu()) {
    cpu::moe_permute_forward(x, r, out);
  } else {
    MC_CUDA_BACKEND(op, cuda::moe_permute_forward(x, r, out));
  }
}

void moe_permute_backward(const Tensor& dout, const MoeRouting& r, Tensor& dx) {
  constexpr const char* op = "moe_permute_backward";
  check_contiguous(op, "dout", dout);
  check_float_dtype(op, "dout", dout);
  check_routing(op, r, dout);
  MC_CHECK(dout.ndim() == 2 && dout.size(0) == r.num_rows, op, ": argument 'dout' has shape ",
           shape_str(dout.shape()), "; expected [num_rows, H] with num_rows = ", r.num_rows);
  check_rows(op, "dx", dx, r.num_tokens, dout, "dout");
  if (dout.device().is_cpu()) {
    cpu::moe_permute_backward(dout, r, dx);
  } else {
    MC_CUDA_BACKEND(op, cuda::moe_permute_backward(dout, r, dx));
  }
}

void moe_unpermute_forward(const Tensor& y, const Tensor& probs, const MoeRouting& r, Tensor& out) {
  constexpr const char* op = "moe_unpermute_forward";
  check_contiguous(op, "y", y);
  check_float_dtype(op, "y", y);
  check_routing(op, r, y);
  MC_CHECK(y.ndim() == 2 && y.size(0) == r.num_rows, op, ": argument 'y' has shape ", shape_str(y.shape()),
           "; expected [num_rows, H] with num_rows = ", r.num_rows);
  check_probs(op, "probs", probs, r);
  check_same_device(op, y, probs);
  check_rows(op, "out", out, r.num_tokens, y, "y");
  if (y.device().is_cpu()) {
    cpu::moe_unpermute_forward(y, probs, r, out);
  } else {
    MC_CUDA_BACKEND(op, cuda::moe_unpermute_forward(y, probs, r, out));
  }
}

void moe_unpermute_backward(const Tensor& y, const Tensor& probs, const MoeRouting& r, const Tensor& dout,
                            Tensor& dy, Tensor& dprobs) {
  constexpr const char* op = "moe_unpermute_backward";
  check_contiguous(op, "y", y);
  check_float_dtype(op, "y", y);
  check_routing(op, r, y);
  MC_CHECK(y.ndim() == 2 && y.size(0) == r.num_rows, op, ": argument 'y' has shape ", shape_str(y.shape()),
           "; expected [num_rows, H] with num_rows = ", r.num_rows);
  check_probs(op, "probs", probs, r);
  check_same_device(op, y, probs);
  check_rows(op, "dout", dout, r.num_tokens, y, "y");
  check_rows(op, "dy", dy, r.num_rows, y, "y");
  check_probs(op, "dprobs", dprobs, r);
  check_same_device(op, y, dprobs);
  MC_CHECK(dprobs.dtype() == probs.dtype(), op, ": 'dprobs' is ", dtype_name(dprobs.dtype()), " but 'probs' is ",
           dtype_name(probs.dtype()));
  if (y.device().is_cpu()) {
    cpu::moe_unpermute_backward(y, probs, r, dout, dy, dprobs);
  } else {
    MC_CUDA_BACKEND(op, cuda::moe_unpermute_backward(y, probs, r, dout, dy, dprobs));
  }
}

void moe_permute_probs_forward(const Tensor& probs, const MoeRouting& r, Tensor& out) {
  constexpr const char* op = "moe_permute_probs_forward";
  check_routing(op, r, probs);
  check_probs(op, "probs", probs, r);
  check_contiguous(op, "out", out);
  check_same_device(op, probs, out);
  check_shape(op, "out", out, {r.num_rows, 1});
  MC_CHECK(out.dtype() == probs.dtype(), op, ": 'out' is ", dtype_name(out.dtype()), " but 'probs' is ",
           dtype_name(probs.dtype()));
  if (probs.device().is_cpu()) {
    cpu::moe_permute_probs_forward(probs, r, out);
  } else {
    MC_CUDA_BACKEND(op, cuda::moe_permute_probs_forward(probs, r, out));
  }
}

void moe_permute_probs_backward(const Tensor& dout, const MoeRouting& r, Tensor& dprobs) {
  constexpr const char* op = "moe_permute_probs_backward";
  check_routing(op, r, dout);
  check_contiguous(op, "dout", dout);
  check_dtype(op, "dout", dout, {DType::F32, DType::F64});
  check_shape(op, "dout", dout, {r.num_rows, 1});
  check_probs(op, "dprobs", dprobs, r);
  check_same_device(op, dout, dprobs);
  MC_CHECK(dprobs.dtype() == dout.dtype(), op, ": 'dprobs' is ", dtype_name(dprobs.dtype()), " but 'dout' is ",
           dtype_name(dout.dtype()));
  if (dout.device().is_cpu()) {
    cpu::moe_permute_probs_backward(dout, r, dprobs);
  } else {
    MC_CUDA_BACKEND(op, cuda::moe_permute_probs_backward(dout, r, dprobs));
  }
}

}  // namespace moecore::ops
