#include "moecore/ops/swiglu.h"

#include <type_traits>

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

// Rows: every dimension but the last (also when that one is 0).
int64_t rows_of(const Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.ndim(); ++d) rows *= x.size(d);
  return rows;
}

// w (and dw): one weight per row of x, f32 (f64 for f64 x).
void check_weights(const char* op, const char* name, const Tensor& x, const Tensor& w) {
  check_contiguous(op, name, w);
  check_same_device(op, x, w);
  const DType want = x.dtype() == DType::F64 ? DType::F64 : DType::F32;
  MC_CHECK(w.dtype() == want, op, ": '", name, "' is ", dtype_name(w.dtype()), " but must be ", dtype_name(want),
           " for ", dtype_name(x.dtype()), " x");
  MC_CHECK(w.numel() == rows_of(x) && w.ndim() >= 1 && w.ndim() <= 2 && (w.ndim() == 1 || w.size(1) == 1), op, ": '",
           name, "' ", w.describe(), " must be [", rows_of(x), "] or [", rows_of(x), ", 1] (one weight per row of x ",
           x.describe(), ")");
}

void run_forward(const char* op, const Tensor& x, const Tensor& w, Tensor& y) {
  check(op, x, y, "y");
  if (w.defined()) check_weights(op, "w", x, w);
  const int64_t f = x.size(-1) / 2, rows = rows_of(x);
  if (x.device().is_cpu()) {
    cpu::swiglu_forward(x, w, y, rows, f);
  } else {
    MC_CUDA_BACKEND(op, cuda::swiglu_forward(x, w, y, rows, f));
  }
}

void run_backward(const char* op, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw) {
  check(op, x, dy, "dy");
  check_contiguous(op, "dx", dx);
  check_same_device(op, x, dx);
  check_same_shape(op, "x", x, "dx", dx);
  MC_CHECK(dx.dtype() == x.dtype(), op, ": dx is ", dtype_name(dx.dtype()), " but x is ", dtype_name(x.dtype()));
  if (w.defined()) {
    check_weights(op, "w", x, w);
    check_weights(op, "dw", x, dw);
  }
  const int64_t f = x.size(-1) / 2, rows = rows_of(x);
  if (x.device().is_cpu()) {
    cpu::swiglu_backward(x, w, dy, dx, dw, rows, f);
  } else {
    MC_CUDA_BACKEND(op, cuda::swiglu_backward(x, w, dy, dx, dw, rows, f));
  }
}
}  // namespace

void swiglu_forward(const Tensor& x, Tensor& y) { run_forward("swiglu_forward", x, Tensor(), y); }

void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  Tensor none;
  run_backward("swiglu_backward", x, Tensor(), dy, dx, none);
}

void weighted_swiglu_forward(const Tensor& x, const Tensor& w, Tensor& y) {
  MC_CHECK(w.defined(), "weighted_swiglu_forward: 'w' is undefined");
  run_forward("weighted_swiglu_forward", x, w, y);
}

void weighted_swiglu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw) {
  MC_CHECK(w.defined(), "weighted_swiglu_backward: 'w' is undefined");
  MC_CHECK(dw.defined(), "weighted_swiglu_backward: 'dw' is undefined (it receives the weights' gradient)");
  run_backward("weighted_swiglu_backward", x, w, dy, dx, dw);
}

namespace cpu {
void swiglu_forward(const Tensor& x, const Tensor& w, Tensor& y, int64_t rows, int64_t f) {
  dispatch_floating(x.dtype(), "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    using W = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* px = x.data<T>();
    const W* pw = w.defined() ? w.data<W>() : nullptr;
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < f; ++i) {
        const auto g = load(px[r * 2 * f + i]), u = load(px[r * 2 * f + f + i]);
        auto v = math::activation(Activation::Silu, g) * u;
        if (pw) v *= pw[r];
        py[r * f + i] = store<T>(v);
      }
  });
}

void swiglu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw, int64_t rows,
                     int64_t f) {
  dispatch_floating(x.dtype(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    using W = std::conditional_t<std::is_same_v<T, double>, double, float>;
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    const W* pw = w.defined() ? w.data<W>() : nullptr;
    W* pdw = pw ? dw.data<W>() : nullptr;
    T* pdx = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      W dot = 0;
      for (int64_t i = 0; i < f; ++i) {
        const auto g = load(px[r * 2 * f + i]), u = load(px[r * 2 * f + f + i]), d0 = load(pdy[r * f + i]);
        const auto silu = math::activation(Activation::Silu, g);
        if (pdw) dot += silu * u * d0;
        const auto d = pw ? d0 * pw[r] : d0;
        pdx[r * 2 * f + i] = store<T>(d * u * math::activation_grad(Activation::Silu, g));
        pdx[r * 2 * f + f + i] = store<T>(d * silu);
      }
      if (pdw) pdw[r] = dot;
    }
  });
}
}  // namespace cpu

}  // namespace moecore::ops
