#include "moecore/ops/elementwise.h"

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {
// cuda_f64: the op has an f64 CUDA kernel (fill only: f64 state such as the step decisions' counters).
void check_float_tensor(const char* op, const char* name, const Tensor& t, bool cuda_f64 = false) {
  check_contiguous(op, name, t);
  MC_CHECK(is_floating(t.dtype()), op, ": argument '", name, "' has dtype ", dtype_name(t.dtype()),
           "; expected a floating dtype");
  MC_CHECK(cuda_f64 || !(t.device().is_cuda() && t.dtype() == DType::F64), op, ": f64 is CPU-only (argument '", name,
           "')");
}

void check_binary(const char* op, const Tensor& a, const Tensor& b, const Tensor& out) {
  check_float_tensor(op, "a", a);
  check_float_tensor(op, "b", b);
  check_float_tensor(op, "out", out);
  check_same_device(op, a, b);
  check_same_device(op, a, out);
  check_same_shape(op, "a", a, "b", b);
  check_same_shape(op, "a", a, "out", out);
  MC_CHECK(a.dtype() == b.dtype() && a.dtype() == out.dtype(), op, ": dtypes differ (", dtype_name(a.dtype()), ", ",
           dtype_name(b.dtype()), " -> ", dtype_name(out.dtype()), "); use cast first");
}

void run_binary(const char* op, BinaryOp kind, float alpha, const Tensor& a, float beta, const Tensor& b, Tensor& out) {
  check_binary(op, a, b, out);
  if (out.device().is_cpu()) {
    cpu::binary(kind, alpha, a, beta, b, out);
  } else {
    MC_CUDA_BACKEND(op, cuda::binary(kind, alpha, a, beta, b, out));
  }
}

void run_activation_forward(const char* op, Activation act, const Tensor& x, Tensor& y) {
  check_float_tensor(op, "x", x);
  check_float_tensor(op, "y", y);
  check_same_device(op, x, y);
  check_same_shape(op, "x", x, "y", y);
  MC_CHECK(x.dtype() == y.dtype(), op, ": x is ", dtype_name(x.dtype()), " but y is ", dtype_name(y.dtype()));
  if (x.device().is_cpu()) {
    cpu::activation_forward(act, x, y);
  } else {
    MC_CUDA_BACKEND(op, cuda::activation_forward(act, x, y));
  }
}

void run_activation_backward(const char* op, Activation act, const Tensor& x, const Tensor& dy, Tensor& dx) {
  check_binary(op, x, dy, dx);
  if (x.device().is_cpu()) {
    cpu::activation_backward(act, x, dy, dx);
  } else {
    MC_CUDA_BACKEND(op, cuda::activation_backward(act, x, dy, dx));
  }
}
}  // namespace

void fill(Tensor& t, double value) {
  check_float_tensor("fill", "t", t, /*cuda_f64=*/true);
  if (t.device().is_cpu()) {
    cpu::fill(t, value);
  } else {
    MC_CUDA_BACKEND("fill", cuda::fill(t, value));
  }
}

void cast(const Tensor& src, Tensor& dst) {
  check_float_tensor("cast", "src", src);
  check_float_tensor("cast", "dst", dst);
  check_same_device("cast", src, dst);
  check_same_shape("cast", "src", src, "dst", dst);
  if (src.device().is_cpu()) {
    cpu::cast(src, dst);
  } else {
    MC_CUDA_BACKEND("cast", cuda::cast(src, dst));
  }
}

Tensor cast_to(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor out = Tensor::empty(t.shape(), dtype, t.device());
  cast(t, out);
  return out;
}

void assign_cast(const Tensor& src, Tensor& dst) {
  if (src.dtype() == dst.dtype()) {
    dst.copy_from(src);
  } else {
    cast(src, dst);
  }
}

std::vector<Tensor> bf16_parts(const Tensor& t, int parts) {
  MC_CHECK(t.dtype() == DType::F32, "bf16_parts: expected an f32 tensor, got ", dtype_name(t.dtype()));
  MC_CHECK(parts >= 1 && parts <= 3, "bf16_parts: parts = ", parts, " (expected 1, 2 or 3)");
  std::vector<Tensor> out;
  Tensor rest = t;
  for (int i = 0; i < parts; ++i) {
    out.push_back(cast_to(rest, DType::BF16));
    if (i + 1 == parts) break;
    Tensor next = Tensor::empty(rest.shape(), DType::F32, rest.device());
    axpby(1.0f, rest, -1.0f, cast_to(out.back(), DType::F32), next);
    rest = next;
  }
  return out;
}

void add(const Tensor& a, const Tensor& b, Tensor& out) { run_binary("add", BinaryOp::Add, 1, a, 1, b, out); }
void mul(const Tensor& a, const Tensor& b, Tensor& out) { run_binary("mul", BinaryOp::Mul, 1, a, 1, b, out); }
void axpby(float alpha, const Tensor& x, float beta, const Tensor& y, Tensor& out) {
  run_binary("axpby", BinaryOp::Axpby, alpha, x, beta, y, out);
}

void silu_forward(const Tensor& x, Tensor& y) { run_activation_forward("silu_forward", Activation::Silu, x, y); }
void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  run_activation_backward("silu_backward", Activation::Silu, x, dy, dx);
}
void gelu_forward(const Tensor& x, Tensor& y) { run_activation_forward("gelu_forward", Activation::Gelu, x, y); }
void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  run_activation_backward("gelu_backward", Activation::Gelu, x, dy, dx);
}

void sigmoid_forward(const Tensor& x, Tensor& y) { run_activation_forward("sigmoid_forward", Activation::Sigmoid, x, y); }
void sigmoid_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  run_activation_backward("sigmoid_backward", Activation::Sigmoid, x, dy, dx);
}

}  // namespace moecore::ops
