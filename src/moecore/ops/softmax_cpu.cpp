#include <cmath>
#include <limits>

#include "moecore/ops/common.h"
#include "moecore/ops/softmax.h"

namespace moecore::ops::cpu {

void softmax_forward(const Tensor& x, Tensor& y, int64_t rows, int64_t cols) {
  dispatch_floating(x.dtype(), "softmax_forward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const T* px = x.data<T>();
    T* py = y.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = px + r * cols;
      T* yr = py + r * cols;
      C mx = -std::numeric_limits<C>::infinity();
      for (int64_t c = 0; c < cols; ++c) mx = std::max(mx, load(xr[c]));
      C sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += std::exp(load(xr[c]) - mx);
      const C inv = C(1) / sum;
      for (int64_t c = 0; c < cols; ++c) yr[c] = store<T>(std::exp(load(xr[c]) - mx) * inv);
    }
  });
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx, int64_t rows, int64_t cols) {
  dispatch_floating(y.dtype(), "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const T* py = y.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t o = r * cols;
      C dot = 0;
      for (int64_t c = 0; c < cols; ++c) dot += load(pdy[o + c]) * load(py[o + c]);
      for (int64_t c = 0; c < cols; ++c) pdx[o + c] = store<T>(load(py[o + c]) * (load(pdy[o + c]) - dot));
    }
  });
}

}  // namespace moecore::ops::cpu
