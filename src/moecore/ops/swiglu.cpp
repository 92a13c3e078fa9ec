#include "moecore/ops/swiglu.h"

#include "moecore/ops/common.h"
#include "moecore/ops/elementwise_math.h"

namespace moecore::ops {

namespace {
void check(const char* op, const Tensor& x, const Tensor& half, const char* half_name) {
  check_contiguous(op, "x", x);
  check_contiguous(op, half_name, half);
  check_same_device(op, x, half);
  check_dtype(op, "x", x, {DType::F32, DType::F64, DType::BF16});
  MC_CHECK(half.dtype() == x.dtype(), op, ": '", half_name, "' is ", dtype_name(half.dtype()), " but x is ",
           dtype_name(x.dtype()));
  MC_CHECK(!(x.device().is_cuda() && x.dtype() == DType::F64), op, ": f64 is CPU-only");
  MC_CHECK(x.ndim() >= 1 && x.size(-1) % 2 == 0, op, ": x ", x.describe(), " needs an even last dimension [gate | up]");
  Shape expected = x.shape();
  expected.back() /= 2;
  check_shape(op, half_name, half, expected);
}
}  // namespace

void swiglu_forward(const Tensor& x, Tensor& y) {
  check("swiglu_forward", x, y, "y");
  const int64_t f = x.size(-1) / 2, rows = f == 0 ? 0 : x.numel() / (2 * f);
  if (x.device().is_cpu()) {
    cpu::swiglu_forward(x, y, rows, f);
  } else {
    MC_CUDA_BACKEND("swiglu_forward", cuda::swiglu_forward(x, y, rows, f));
  }
}

void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  check("swiglu_backward", x, dy, "dy");
  check_contiguous("swiglu_backward", "dx", dx);
  check_same_device("swiglu_backward", x, dx);
  check_same_shape("swiglu_backward", "x", x, "dx", dx);
  MC_CHECK(dx.dtype() == x.dtype(), "swiglu_backward: dx is ", dtype_name(dx.dtype()), " but x is ",
           dtype_name(x.dtype()));
  const int64_t f = x.size(-1) / 2, rows = f == 0 ? 0 : x.numel() / (2 * f);
  if (x.device().is_cpu()) {
    cpu::swiglu_backward(x, dy, dx, rows, f);
  } else {
    MC_CUDA_BACKEND("swiglu_backward", cuda::swiglu_backward(x, dy, dx, rows, f));
  }
}

namespace cpu {
void swiglu_forward(const Tensor& x, Tensor& y, int64_t rows, int64_t f) {
  dispatch_floating(x.dtype(), "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < f; ++i) {
        const auto g = load(px[r * 2 * f + i]), u = load(px[r * 2 * f + f + i]);
        py[r * f + i] = store<T>(math::activation(Activation::Silu, g) * u);
      }
  });
}

void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx, int64_t rows, int64_t f) {
  dispatch_floating(x.dtype(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < f; ++i) {
        const auto g = load(px[r * 2 * f + i]), u = load(px[r * 2 * f + f + i]), d = load(pdy[r * f + i]);
        pdx[r * 2 * f + i] = store<T>(d * u * math::activation_grad(Activation::Silu, g));
        pdx[r * 2 * f + f + i] = store<T>(d * math::activation(Activation::Silu, g));
      }
  });
}
}  // namespace cpu

}  // namespace moecore::ops
