#include "moecore/ops/attention.h"

#include <cmath>

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {

// Checks q, k, v (and the scale) and returns the sizes.
AttentionDims check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  check_contiguous(op, "q", q);
  check_contiguous(op, "k", k);
  check_contiguous(op, "v", v);
  check_same_device(op, q, k);
  check_same_device(op, q, v);
  check_dtype(op, "q", q, {DType::F32, DType::F64, DType::BF16});
  MC_CHECK(!(q.device().is_cuda() && q.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(q.ndim() == 4, op, ": 'q' must be [B, S, Hq, D], got shape ", shape_str(q.shape()));
  MC_CHECK(k.ndim() == 4, op, ": 'k' must be [B, Sk, Hkv, D], got shape ", shape_str(k.shape()));
  MC_CHECK(v.ndim() == 4, op, ": 'v' must be [B, Sk, Hkv, Dv], got shape ", shape_str(v.shape()));
  const AttentionDims d{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), k.size(1), v.size(3)};
  MC_CHECK(d.batch > 0 && d.seq > 0 && d.kv_seq > 0 && d.q_heads > 0 && d.head_dim > 0 && d.kv_heads > 0, op,
           ": every dimension must be positive; 'q' has shape ", shape_str(q.shape()), " and 'k' ",
           shape_str(k.shape()));
  const char* names[] = {"batch size B", nullptr, nullptr, "head dim D"};
  for (int i : {0, 3})
    MC_CHECK(k.size(i) == q.size(i), op, ": ", names[i], " differs: 'q' has shape ", shape_str(q.shape()),
             " but 'k' has shape ", shape_str(k.shape()));
  // Keys may outnumber queries (the queries are the last Sq positions), never the reverse.
  MC_CHECK(d.kv_seq >= d.seq, op, ": key/value sequence length Sk = ", d.kv_seq,
           " must be >= query sequence length Sq = ", d.seq, ": 'q' has shape ", shape_str(q.shape()),
           " but 'k' has shape ", shape_str(k.shape()));
  MC_CHECK(d.q_heads % d.kv_heads == 0, op, ": query heads Hq = ", d.q_heads,
           " must be a multiple of kv heads Hkv = ", d.kv_heads, " ('q' ", shape_str(q.shape()), ", 'k' ",
           shape_str(k.shape()), ")");
  MC_CHECK(d.v_head_dim > 0, op, ": value head dim Dv must be positive; 'v' has shape ", shape_str(v.shape()));
  for (int i : {0, 1, 2})
    MC_CHECK(v.size(i) == k.size(i), op, ": 'k' and 'v' must agree in [B, Sk, Hkv]: 'k' has shape ",
             shape_str(k.shape()), " but 'v' has shape ", shape_str(v.shape()));
  for (const Tensor* t : {&k, &v})
    MC_CHECK(t->dtype() == q.dtype(), op, ": 'q' is ", dtype_name(q.dtype()), " but '", t == &k ? "k" : "v",
             "' is ", dtype_name(t->dtype()));
  MC_CHECK(std::isfinite(scale), op, ": softmax_scale must be finite, got ", scale);
  return d;
}

// `t` must be contiguous, on q's device, with `like`'s dtype and the shape given.
void check_like(const char* op, const char* name, const Tensor& t, const Tensor& q, DType dtype, const Shape& shape) {
  check_contiguous(op, name, t);
  check_same_device(op, q, t);
  check_shape(op, name, t, shape);
  MC_CHECK(t.dtype() == dtype, op, ": argument '", name, "' has dtype ", dtype_name(t.dtype()), "; expected ",
           dtype_name(dtype));
}

DType lse_dtype(const Tensor& q) { return q.dtype() == DType::F64 ? DType::F64 : DType::F32; }

// [B, Sq, Hq, Dv]: the shape of out and dout.
Shape out_shape(const AttentionDims& d) { return {d.batch, d.seq, d.q_heads, d.value_dim()}; }

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, Tensor& out,
                       Tensor& lse) {
  const char* op = "attention_forward";
  const AttentionDims d = check_qkv(op, q, k, v, softmax_scale);
  check_like(op, "out", out, q, q.dtype(), out_shape(d));
  check_like(op, "lse", lse, q, lse_dtype(q), {d.batch, d.q_heads, d.seq});
  if (q.device().is_cpu()) {
    cpu::attention_forward(q, k, v, softmax_scale, out, lse, d);
  } else {
    MC_CUDA_BACKEND(op, cuda::attention_forward(q, k, v, softmax_scale, out, lse, d));
  }
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, double softmax_scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  const char* op = "attention_backward";
  const AttentionDims d = check_qkv(op, q, k, v, softmax_scale);
  check_like(op, "out", out, q, q.dtype(), out_shape(d));
  check_like(op, "lse", lse, q, lse_dtype(q), {d.batch, d.q_heads, d.seq});
  check_like(op, "dout", dout, q, q.dtype(), out_shape(d));
  check_like(op, "dq", dq, q, q.dtype(), q.shape());
  check_like(op, "dk", dk, q, q.dtype(), k.shape());
  check_like(op, "dv", dv, q, q.dtype(), v.shape());
  if (q.device().is_cpu()) {
    cpu::attention_backward(q, k, v, out, lse, dout, softmax_scale, dq, dk, dv, d);
  } else {
    MC_CUDA_BACKEND(op, cuda::attention_backward(q, k, v, out, lse, dout, softmax_scale, dq, dk, dv, d));
  }
}

}  // namespace moecore::ops
