#include "moecore/ops/rope.h"

#include <algorithm>
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

void run(const char* op, const Tensor& in, Tensor& out, double base, const RopeScaling& scaling,
         int64_t position_offset, bool inverse) {
  const RopeFrequencies f = rope_frequencies(base, in.size(3), scaling);
  if (in.device().is_cpu()) {
    cpu::rope(in, out, f, position_offset, inverse);
  } else {
    MC_CUDA_BACKEND(op, cuda::rope(in, out, f, position_offset, inverse));
  }
}

// HF's / Megatron's correction dim: where `rotations` full turns fit in the original context.
double correction_dim(double rotations, int64_t dim, double base, double original_max_position) {
  return static_cast<double>(dim) * std::log(original_max_position / (rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
}

}  // namespace

double yarn_mscale(double factor, double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; }

RopeFrequencies rope_frequencies(double base, int64_t dim, const RopeScaling& s) {
  RopeFrequencies f;
  f.base = base;
  f.dim = dim;
  if (!s.yarn()) return f;
  MC_CHECK(std::isfinite(s.factor) && s.original_max_position > 0 && s.beta_fast > 0 && s.beta_slow > 0,
           "rope: YaRN needs a factor > 0, an original context > 0 and beta_fast, beta_slow > 0; got factor ", s.factor,
           ", original context ", s.original_max_position, ", betas ", s.beta_fast, ", ", s.beta_slow);
  f.yarn = true;
  f.factor = s.factor;
  f.low = std::max(std::floor(correction_dim(s.beta_fast, dim, base, s.original_max_position)), 0.0);
  f.high = std::min(std::ceil(correction_dim(s.beta_slow, dim, base, s.original_max_position)),
                    static_cast<double>(dim - 1));
  if (f.high == f.low) f.high += 0.001;  // no division by zero (as both references)
  f.attention = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  return f;
}

void rope_forward(const Tensor& x, Tensor& y, double base, int64_t position_offset) {
  rope_forward(x, y, base, RopeScaling{}, position_offset);
}

void rope_backward(const Tensor& dy, Tensor& dx, double base, int64_t position_offset) {
  rope_backward(dy, dx, base, RopeScaling{}, position_offset);
}

void rope_forward(const Tensor& x, Tensor& y, double base, const RopeScaling& scaling, int64_t position_offset) {
  check_rope("rope_forward", "x", x, "y", y, base, position_offset);
  run("rope_forward", x, y, base, scaling, position_offset, false);
}

void rope_backward(const Tensor& dy, Tensor& dx, double base, const RopeScaling& scaling, int64_t position_offset) {
  check_rope("rope_backward", "dy", dy, "dx", dx, base, position_offset);
  run("rope_backward", dy, dx, base, scaling, position_offset, true);
}

}  // namespace moecore::ops
