#include "moecore/ops/reduce.h"

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {

void check_io(const char* op, const Tensor& x, const Tensor& out) {
  check_contiguous(op, "x", x);
  check_contiguous(op, "out", out);
  check_same_device(op, x, out);
  MC_CHECK(is_floating(x.dtype()), op, ": x has dtype ", dtype_name(x.dtype()), "; expected a floating dtype");
  MC_CHECK(!(x.device().is_cuda() && x.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(x.ndim() >= 1, op, ": x must have at least one dimension");
  const bool ok = out.dtype() == x.dtype() || (out.dtype() == DType::F32 && x.dtype() != DType::F64);
  MC_CHECK(ok, op, ": out has dtype ", dtype_name(out.dtype()), "; expected ", dtype_name(x.dtype()),
           x.dtype() == DType::F64 ? "" : " or f32");
}

void rows(const char* op, RowReduce kind, const Tensor& x, Tensor& out) {
  check_io(op, x, out);
  Shape expected(x.shape().begin(), x.shape().end() - 1);
  check_shape(op, "out", out, expected);
  const int64_t cols = x.size(-1), nrows = cols == 0 ? shape_numel(expected) : x.numel() / cols;
  MC_CHECK(cols > 0 || kind == RowReduce::Sum, op, ": max over an empty last dimension");
  if (x.device().is_cpu()) {
    cpu::reduce_rows(kind, x, out, nrows, cols);
  } else {
    MC_CUDA_BACKEND(op, cuda::reduce_rows(kind, x, out, nrows, cols));
  }
}

void total(const char* op, TotalReduce kind, const Tensor& x, Tensor& out) {
  check_io(op, x, out);
  check_shape(op, "out", out, {1});
  if (x.device().is_cpu()) {
    cpu::reduce_total(kind, x, out);
  } else {
    MC_CUDA_BACKEND(op, cuda::reduce_total(kind, x, out));
  }
}

}  // namespace

void sum_last_dim(const Tensor& x, Tensor& out) { rows("sum_last_dim", RowReduce::Sum, x, out); }
void max_last_dim(const Tensor& x, Tensor& out) { rows("max_last_dim", RowReduce::Max, x, out); }

void sum_leading_dims(const Tensor& x, Tensor& out) {
  constexpr const char* op = "sum_leading_dims";
  check_io(op, x, out);
  const int64_t cols = x.size(-1);
  check_shape(op, "out", out, {cols});
  const int64_t nrows = cols == 0 ? 0 : x.numel() / cols;
  if (x.device().is_cpu()) {
    cpu::sum_columns(x, out, nrows, cols);
  } else {
    MC_CUDA_BACKEND(op, cuda::sum_columns(x, out, nrows, cols));
  }
}

void sum_all(const Tensor& x, Tensor& out) { total("sum_all", TotalReduce::Sum, x, out); }
void sum_squares(const Tensor& x, Tensor& out) { total("sum_squares", TotalReduce::SumSquares, x, out); }

}  // namespace moecore::ops
