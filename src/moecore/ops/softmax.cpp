#include "moecore/ops/softmax.h"

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {
void check_pair(const char* op, const char* na, const Tensor& a, const char* nb, const Tensor& b) {
  check_contiguous(op, na, a);
  check_contiguous(op, nb, b);
  check_same_device(op, a, b);
  check_same_shape(op, na, a, nb, b);
  check_dtype(op, na, a, {DType::F32, DType::F64, DType::BF16});
  MC_CHECK(a.dtype() == b.dtype(), op, ": '", na, "' is ", dtype_name(a.dtype()), " but '", nb, "' is ",
           dtype_name(b.dtype()));
  MC_CHECK(!(a.device().is_cuda() && a.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(a.ndim() >= 1 && a.size(-1) > 0, op, ": needs a non-empty last dimension, got ", a.describe());
}
}  // namespace

void softmax_forward(const Tensor& x, Tensor& y) {
  check_pair("softmax_forward", "x", x, "y", y);
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  if (x.device().is_cpu()) {
    cpu::softmax_forward(x, y, rows, cols);
  } else {
    MC_CUDA_BACKEND("softmax_forward", cuda::softmax_forward(x, y, rows, cols));
  }
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  check_pair("softmax_backward", "y", y, "dy", dy);
  check_pair("softmax_backward", "y", y, "dx", dx);
  const int64_t cols = y.size(-1), rows = y.numel() / cols;
  if (y.device().is_cpu()) {
    cpu::softmax_backward(y, dy, dx, rows, cols);
  } else {
    MC_CUDA_BACKEND("softmax_backward", cuda::softmax_backward(y, dy, dx, rows, cols));
  }
}

}  // namespace moecore::ops
