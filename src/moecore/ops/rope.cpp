#include "moecore/ops/rope.h"

#include <cmath>

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {

void check_rope(const char* op, const char* in_name, const Tensor& in, const char* out_name, const Tensor& out,
                double base, int64_t position_offset) {
  check_contiguous(op, in_name, in);
  check_contiguous(op, out_name, out);
  check_same_device(op, in, out);
  check_dtype(op, in_name, in, {DType::F32, DType::F64, DType::BF16});
  MC_CHECK(out.dtype() == in.dtype(), op, ": '", in_name, "' is ", dtype_name(in.dtype()), " but '", out_name,
           "' is ", dtype_name(out.dtype()));
  MC_CHECK(!(in.device().is_cuda() && in.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(in.ndim() == 4, op, ": '", in_name, "' must be [B, S, N, D] (4 dimensions), got shape ",
           shape_str(in.shape()));
  MC_CHECK(in.size(3) > 0 && in.size(3) % 2 == 0, op, ": head dim D = ", in.size(3), " of '", in_name,
           "' must be even and positive");
  check_same_shape(op, in_name, in, out_name, out);
  MC_CHECK(std::isfinite(base) && base > 0.0, op, ": base must be finite and > 0, got ", base);
  MC_CHECK(position_offset >= 0, op, ": position_offset must be >= 0, got ", position_offset);
}

void run(const char* op, const Tensor& in, Tensor& out, double base, int64_t position_offset, bool inverse) {
  if (in.device().is_cpu()) {
    cpu::rope(in, out, base, position_offset, inverse);
  } else {
    MC_CUDA_BACKEND(op, cuda::rope(in, out, base, position_offset, inverse));
  }
}

}  // namespace

void rope_forward(const Tensor& x, Tensor& y, double base, int64_t position_offset) {
  check_rope("rope_forward", "x", x, "y", y, base, position_offset);
  run("rope_forward", x, y, base, position_offset, false);
}

void rope_backward(const Tensor& dy, Tensor& dx, double base, int64_t position_offset) {
  check_rope("rope_backward", "dy", dy, "dx", dx, base, position_offset);
  run("rope_backward", dy, dx, base, position_offset, true);
}

}  // namespace moecore::ops
