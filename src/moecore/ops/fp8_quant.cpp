// FP8 quantisation and GEMM: argument checks, scale arithmetic, and the backend dispatch.
#include "moecore/ops/fp8_quant.h"

#include <cmath>

#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_matrix(const char* op, const Tensor& x) {
  check_defined(op, "x", x);
  check_contiguous(op, "x", x);
  check_dtype(op, "x", x, {DType::F32, DType::BF16});
  MC_CHECK(x.ndim() == 2, op, ": x must be 2-D; got ", x.describe());
}


void check_operand(const char* op, const char* name, const Fp8Tensor& t) {
  check_defined(op, name, t.data);
  check_dtype(op, name, t.data, {DType::FP8E4M3, DType::FP8E5M2});
  MC_CHECK(t.data.ndim() == 2, op, ": ", name, " must be 2-D; got ", t.data.describe());
  check_dtype(op, name, t.scale_inv, {DType::F32});
  const int64_t r = t.rows(), c = t.cols(), b = kFp8BlockSize;
  const Shape want = t.scaling == Fp8Scaling::PerTensor   ? Shape{1}
                     : t.scaling == Fp8Scaling::Tile1x128 ? Shape{r, ceil_div(c, b)}
                                                          : Shape{ceil_div(r, b), ceil_div(c, b)};
  MC_CHECK(t.scale_inv.shape() == want, op, ": ", name, "'s scale_inv is ", shape_str(t.scale_inv.shape()),
           "; expected ", shape_str(want), " for its ", r, " x ", c, " codes");
}

Fp8Tensor make(int64_t rows, int64_t cols, Fp8Format f, Fp8Scaling s, Device dev) {
  Fp8Tensor t;
  t.scaling = s;
  t.data = Tensor::empty({rows, cols}, fp8_dtype(f), dev);
  const int64_t b = kFp8BlockSize;
  const Shape sh = s == Fp8Scaling::PerTensor   ? Shape{1}
                   : s == Fp8Scaling::Tile1x128 ? Shape{rows, ceil_div(cols, b)}
                                                : Shape{ceil_div(rows, b), ceil_div(cols, b)};
  t.scale_inv = Tensor::empty(sh, DType::F32, dev);
  return t;
}
}  // namespace

DType fp8_dtype(Fp8Format f) { return f == Fp8Format::E4M3 ? DType::FP8E4M3 : DType::FP8E5M2; }
const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::E4M3 ? "e4m3" : "e5m2"; }

float amax(const Tensor& x) {
  constexpr const char* op = "fp8 amax";
  check_defined(op, "x", x);
  check_contiguous(op, "x", x);
  check_dtype(op, "x", x, {DType::F32, DType::BF16});
  if (x.device().is_cpu()) return cpu::amax(x);
  float r = 0.0f;
  MC_CUDA_BACKEND(op, r = cuda::amax(x));
  return r;
}

Fp8Tensor quantize_per_tensor(const Tensor& x, float scale, Fp8Format f) {
  constexpr const char* op = "fp8 quantize_per_tensor";
  check_matrix(op, x);
  MC_CHECK(scale > 0.0f && std::isfinite(scale), op, ": the scale must be positive and finite; got ", scale);
  Fp8Tensor t = make(x.size(0), x.size(1), f, Fp8Scaling::PerTensor, x.device());
  if (x.device().is_cpu()) {
    cpu::quantize_per_tensor(x, scale, t);
  } else {
    MC_CUDA_BACKEND(op, cuda::quantize_per_tensor(x, scale, t));
  }
  return t;
}

Fp8Tensor quantize_tiles(const Tensor& x, Fp8Format f, bool transpose) {
  constexpr const char* op = "fp8 quantize_tiles";
  check_matrix(op, x);
  Fp8Tensor t = transpose ? make(x.size(1), x.size(0), f, Fp8Scaling::Tile1x128, x.device())
                          : make(x.size(0), x.size(1), f, Fp8Scaling::Tile1x128, x.device());
  if (x.device().is_cpu()) {
    cpu::quantize_tiles(x, transpose, t);
  } else {
    MC_CUDA_BACKEND(op, cuda::quantize_tiles(x, transpose, t));
  }
  return t;
}

Fp8Tensor quantize_blocks(const Tensor& x, Fp8Format f) {
  constexpr const char* op = "fp8 quantize_blocks";
  check_matrix(op, x);
  Fp8Tensor t = make(x.size(0), x.size(1), f, Fp8Scaling::Block128, x.device());
  if (x.device().is_cpu()) {
    cpu::quantize_blocks(x, t);
  } else {
    MC_CUDA_BACKEND(op, cuda::quantize_blocks(x, t));
  }
  return t;
}

Tensor block_amax(const Tensor& x) {
  constexpr const char* op = "fp8 block_amax";
  check_matrix(op, x);
  const int64_t b = kFp8BlockSize;
  Tensor out = Tensor::empty({ceil_div(x.size(0), b), ceil_div(x.size(1), b)}, DType::F32, x.device());
  if (x.device().is_cpu()) {
    cpu::block_amax(x, out);
  } else {
    MC_CUDA_BACKEND(op, cuda::block_amax(x, out));
  }
  return out;
}

Fp8Tensor quantize_blocks(const Tensor& x, const Tensor& block_amax, Fp8Format f) {
  constexpr const char* op = "fp8 quantize_blocks (given amaxes)";
  check_matrix(op, x);
  Fp8Tensor t = make(x.size(0), x.size(1), f, Fp8Scaling::Block128, x.device());
  check_defined(op, "block_amax", block_amax);
  check_contiguous(op, "block_amax", block_amax);
  check_dtype(op, "block_amax", block_amax, {DType::F32});
  check_same_device(op, x, block_amax);
  MC_CHECK(block_amax.shape() == t.scale_inv.shape(), op, ": block_amax is ", shape_str(block_amax.shape()),
           "; expected ", shape_str(t.scale_inv.shape()), " for x ", x.describe());
  if (x.device().is_cpu()) {
    cpu::quantize_blocks(x, block_amax, t);
  } else {
    MC_CUDA_BACKEND(op, cuda::quantize_blocks(x, block_amax, t));
  }
  return t;
}

Fp8Tensor fp8_transpose(const Fp8Tensor& t) {
  constexpr const char* op = "fp8_transpose";
  check_operand(op, "t", t);
  MC_CHECK(t.scaling != Fp8Scaling::Tile1x128, op, ": 1x128 tiles do not transpose into 1x128 tiles; quantise the "
           "transpose from the high-precision values (quantize_tiles(x, f, true))");
  Fp8Tensor out = make(t.cols(), t.rows(), t.format(), t.scaling, t.data.device());
  if (t.data.device().is_cpu()) {
    cpu::fp8_transpose(t, out);
  } else {
    MC_CUDA_BACKEND(op, cuda::fp8_transpose(t, out));
  }
  return out;
}

Tensor dequantize(const Fp8Tensor& t) {
  constexpr const char* op = "fp8 dequantize";
  check_operand(op, "t", t);
  Tensor out = Tensor::empty({t.rows(), t.cols()}, DType::F32, t.data.device());
  if (t.data.device().is_cpu()) {
    cpu::dequantize(t, out);
  } else {
    MC_CUDA_BACKEND(op, cuda::dequantize(t, out));
  }
  return out;
}

void fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& c, float beta) {
  constexpr const char* op = "fp8_gemm";
  check_operand(op, "A", a);
  check_operand(op, "B", b);
  check_contiguous(op, "C", c);
  check_dtype(op, "C", c, {DType::F32, DType::BF16});
  check_same_device(op, a.data, b.data);
  check_same_device(op, a.data, c);
  check_same_device(op, a.data, a.scale_inv);
  check_same_device(op, b.data, b.scale_inv);
  MC_CHECK(a.cols() == b.cols(), op, ": A is [", a.rows(), ", ", a.cols(), "] and B is [", b.rows(), ", ", b.cols(),
           "]: both must be K-major with the same K (C = A . B^T)");
  MC_CHECK(c.ndim() == 2 && c.size(0) == a.rows() && c.size(1) == b.rows(), op, ": C is ", c.describe(),
           "; expected [", a.rows(), ", ", b.rows(), "]");
  MC_CHECK(!(a.format() == Fp8Format::E5M2 && b.format() == Fp8Format::E5M2), op,
           ": E5M2 x E5M2 is not an FP8 GEMM Hopper runs (one operand must be E4M3)");
  if (c.device().is_cpu()) {
    cpu::fp8_gemm(a, b, c, beta);
  } else {
    MC_CUDA_BACKEND(op, cuda::fp8_gemm(a, b, c, beta));
  }
}

}  // namespace moecore::ops
