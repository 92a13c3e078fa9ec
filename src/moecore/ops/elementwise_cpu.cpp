#include "moecore/ops/common.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/elementwise_math.h"

namespace moecore::ops::cpu {

void fill(Tensor& t, double value) {
  dispatch_floating(t.dtype(), "fill", [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>();
    const T v = store<T>(static_cast<Compute<T>>(value));
    const int64_t n = t.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] = v;
  });
}

void cast(const Tensor& src, Tensor& dst) {
  dispatch_floating(src.dtype(), "cast", [&](auto stag) {
    using S = decltype(stag);
    dispatch_floating(dst.dtype(), "cast", [&](auto dtag) {
      using D = decltype(dtag);
      const S* s = src.data<S>();
      D* d = dst.data<D>();
      const int64_t n = src.numel();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        if constexpr (std::is_same_v<S, double> || std::is_same_v<D, double>) {
          d[i] = store<D>(static_cast<double>(load(s[i])));
        } else {
          d[i] = store<D>(load(s[i]));
        }
      }
    });
  });
}

void binary(BinaryOp op, float alpha, const Tensor& a, float beta, const Tensor& b, Tensor& out) {
  dispatch_floating(a.dtype(), "binary", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.data<T>();
    const int64_t n = a.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      po[i] = store<T>(math::binary<C>(op, C(alpha), load(pa[i]), C(beta), load(pb[i])));
  });
}

void activation_forward(Activation act, const Tensor& x, Tensor& y) {
  dispatch_floating(x.dtype(), "activation", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) py[i] = store<T>(math::activation(act, load(px[i])));
  });
}

void activation_backward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx) {
  dispatch_floating(x.dtype(), "activation_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pdx[i] = store<T>(load(pdy[i]) * math::activation_grad(act, load(px[i])));
  });
}

}  // namespace moecore::ops::cpu
