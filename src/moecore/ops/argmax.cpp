#include "moecore/ops/argmax.h"

#include <algorithm>

#include "moecore/ops/common.h"

namespace moecore::ops {

void argmax_rows(const Tensor& x, Tensor& out) {
  constexpr const char* op = "argmax_rows";
  check_contiguous(op, "x", x);
  check_contiguous(op, "out", out);
  check_dtype(op, "x", x, {DType::F32});
  check_dtype(op, "out", out, {DType::I32});
  check_same_device(op, x, out);
  MC_CHECK(x.ndim() == 2 && x.size(1) > 0, op, ": x must be [R, C] with C > 0, got ", shape_str(x.shape()));
  check_shape(op, "out", out, {x.size(0)});
  if (x.device().is_cuda()) {
    MC_CUDA_BACKEND(op, cuda::argmax_rows(x, out));
    return;
  }
  const int64_t rows = x.size(0), cols = x.size(1);
  const float* p = x.data<float>();
  int32_t* o = out.data<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = p + r * cols;
    o[r] = static_cast<int32_t>(std::max_element(row, row + cols) - row);
  }
}

}  // namespace moecore::ops
