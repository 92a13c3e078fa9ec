#include "moecore/ops/norm.h"

#include <cmath>

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {

// Statistics and parameter gradients are f32, or f64 for f64 data.
DType stat_dtype(DType x) { return x == DType::F64 ? DType::F64 : DType::F32; }

// x itself: contiguous, a floating dtype the op supports, a non-empty last dimension.
void check_x(const char* op, const char* name, const Tensor& x) {
  check_contiguous(op, name, x);
  check_dtype(op, name, x, {DType::F32, DType::F64, DType::BF16});
  MC_CHECK(!(x.device().is_cuda() && x.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(x.ndim() >= 1 && x.size(-1) > 0, op, ": '", name, "' needs a non-empty last dimension, got ",
           x.describe());
}

// A tensor with x's shape and dtype on x's device (y, dy, dx).
void check_like_x(const char* op, const Tensor& x, const char* name, const Tensor& t) {
  check_contiguous(op, name, t);
  check_same_device(op, x, t);
  check_same_shape(op, "x", x, name, t);
  MC_CHECK(t.dtype() == x.dtype(), op, ": argument '", name, "' has dtype ", dtype_name(t.dtype()),
           "; expected x's dtype ", dtype_name(x.dtype()));
}

// A [H] vector on x's device with the given dtype (weight, bias, dweight, dbias).
void check_vector(const char* op, const Tensor& x, const char* name, const Tensor& t, DType dtype) {
  check_contiguous(op, name, t);
  check_same_device(op, x, t);
  check_shape(op, name, t, {x.size(-1)});
  MC_CHECK(t.dtype() == dtype, op, ": argument '", name, "' has dtype ", dtype_name(t.dtype()), "; expected ",
           dtype_name(dtype));
}

// A per-row statistic (mean, rstd): [rows] or x's leading shape, f32 (f64 for f64 x).
void check_stat(const char* op, const Tensor& x, const char* name, const Tensor& t) {
  check_contiguous(op, name, t);
  check_same_device(op, x, t);
  const int64_t rows = x.numel() / x.size(-1);
  const Shape leading(x.shape().begin(), x.shape().end() - 1);
  MC_CHECK(t.shape() == Shape{rows} || t.shape() == leading, op, ": argument '", name, "' has shape ",
           shape_str(t.shape()), "; expected (", rows, ") (one value per row of x ", shape_str(x.shape()), ")");
  const DType want = stat_dtype(x.dtype());
  MC_CHECK(t.dtype() == want, op, ": argument '", name, "' has dtype ", dtype_name(t.dtype()), "; expected ",
           dtype_name(want));
}

void check_eps(const char* op, double eps) {
  MC_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be finite and >= 0, got ", eps);
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& weight, double eps, Tensor& y, Tensor& rstd) {
  constexpr const char* op = "rmsnorm_forward";
  check_x(op, "x", x);
  check_vector(op, x, "weight", weight, x.dtype());
  check_like_x(op, x, "y", y);
  check_stat(op, x, "rstd", rstd);
  check_eps(op, eps);
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (x.device().is_cpu()) {
    cpu::norm_forward(x, weight, nullptr, eps, y, nullptr, rstd, rows, cols);
  } else {
    MC_CUDA_BACKEND(op, cuda::norm_forward(x, weight, nullptr, eps, y, nullptr, rstd, rows, cols));
  }
}

void rmsnorm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dweight) {
  constexpr const char* op = "rmsnorm_backward";
  check_x(op, "x", x);
  check_vector(op, x, "weight", weight, x.dtype());
  check_stat(op, x, "rstd", rstd);
  check_like_x(op, x, "dy", dy);
  check_like_x(op, x, "dx", dx);
  check_vector(op, x, "dweight", dweight, stat_dtype(x.dtype()));
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (x.device().is_cpu()) {
    cpu::norm_backward(x, weight, nullptr, rstd, dy, dx, dweight, nullptr, rows, cols);
  } else {
    MC_CUDA_BACKEND(op, cuda::norm_backward(x, weight, nullptr, rstd, dy, dx, dweight, nullptr, rows, cols));
  }
}

void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, Tensor& y, Tensor& mean,
                       Tensor& rstd) {
  constexpr const char* op = "layernorm_forward";
  check_x(op, "x", x);
  check_vector(op, x, "weight", weight, x.dtype());
  check_vector(op, x, "bias", bias, x.dtype());
  check_like_x(op, x, "y", y);
  check_stat(op, x, "mean", mean);
  check_stat(op, x, "rstd", rstd);
  check_eps(op, eps);
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (x.device().is_cpu()) {
    cpu::norm_forward(x, weight, &bias, eps, y, &mean, rstd, rows, cols);
  } else {
    MC_CUDA_BACKEND(op, cuda::norm_forward(x, weight, &bias, eps, y, &mean, rstd, rows, cols));
  }
}

void layernorm_backward(const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        const Tensor& dy, Tensor& dx, Tensor& dweight, Tensor& dbias) {
  constexpr const char* op = "layernorm_backward";
  check_x(op, "x", x);
  check_vector(op, x, "weight", weight, x.dtype());
  check_stat(op, x, "mean", mean);
  check_stat(op, x, "rstd", rstd);
  check_like_x(op, x, "dy", dy);
  check_like_x(op, x, "dx", dx);
  check_vector(op, x, "dweight", dweight, stat_dtype(x.dtype()));
  check_vector(op, x, "dbias", dbias, stat_dtype(x.dtype()));
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (x.device().is_cpu()) {
    cpu::norm_backward(x, weight, &mean, rstd, dy, dx, dweight, &dbias, rows, cols);
  } else {
    MC_CUDA_BACKEND(op, cuda::norm_backward(x, weight, &mean, rstd, dy, dx, dweight, &dbias, rows, cols));
  }
}

}  // namespace moecore::ops
