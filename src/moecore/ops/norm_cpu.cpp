// CPU RMSNorm / LayerNorm: rows in parallel (OpenMP). The weight/bias gradients are summed
// per column over all rows in row order (columns split among threads), so they do not depend
// on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "moecore/ops/common.h"
#include "moecore/ops/norm.h"

namespace moecore::ops::cpu {

void norm_forward(const Tensor& x, const Tensor& weight, const Tensor* bias, double eps, Tensor& y, Tensor* mean,
                  Tensor& rstd, int64_t rows, int64_t cols) {
  dispatch_floating(x.dtype(), "norm_forward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const T* px = x.data<T>();
    const T* pw = weight.data<T>();
    const T* pb = bias ? bias->data<T>() : nullptr;
    T* py = y.data<T>();
    C* pmean = mean ? mean->data<C>() : nullptr;
    C* prstd = rstd.data<C>();
    const C n = static_cast<C>(cols), e = static_cast<C>(eps);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = px + r * cols;
      T* yr = py + r * cols;
      C mu = 0;
      if (pmean) {
        for (int64_t c = 0; c < cols; ++c) mu += load(xr[c]);
        mu /= n;
      }
      C ss = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const C d = load(xr[c]) - mu;
        ss += d * d;
      }
      const C rs = C(1) / std::sqrt(ss / n + e);
      for (int64_t c = 0; c < cols; ++c) {
        C v = (load(xr[c]) - mu) * rs * load(pw[c]);
        if (pb) v += load(pb[c]);
        yr[c] = store<T>(v);
      }
      if (pmean) pmean[r] = mu;
      prstd[r] = rs;
    }
  });
}

void norm_backward(const Tensor& x, const Tensor& weight, const Tensor* mean, const Tensor& rstd, const Tensor& dy,
                   Tensor& dx, Tensor& dweight, Tensor* dbias, int64_t rows, int64_t cols) {
  dispatch_floating(x.dtype(), "norm_backward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const T* px = x.data<T>();
    const T* pw = weight.data<T>();
    const T* pdy = dy.data<T>();
    T* pdx = dx.data<T>();
    const C* pmean = mean ? mean->data<C>() : nullptr;
    const C* prstd = rstd.data<C>();
    const C n = static_cast<C>(cols);

    // Parameter gradients first: dx may alias dy. Columns in blocks of 64, rows in order.
    C* pdw = dweight.data<C>();
    C* pdb = dbias ? dbias->data<C>() : nullptr;
    constexpr int64_t kBlock = 64;
    const int64_t nblocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t c0 = b * kBlock, c1 = std::min(cols, c0 + kBlock);
      double gw[kBlock] = {}, gb[kBlock] = {};
      for (int64_t r = 0; r < rows; ++r) {
        const C mu = pmean ? pmean[r] : C(0), rs = prstd[r];
        for (int64_t c = c0; c < c1; ++c) {
          const C g = load(pdy[r * cols + c]);
          gw[c - c0] += static_cast<double>(g * ((load(px[r * cols + c]) - mu) * rs));
          gb[c - c0] += static_cast<double>(g);
        }
      }
      for (int64_t c = c0; c < c1; ++c) {
        pdw[c] = static_cast<C>(static_cast<double>(pdw[c]) + gw[c - c0]);
        if (pdb) pdb[c] = static_cast<C>(static_cast<double>(pdb[c]) + gb[c - c0]);
      }
    }

#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t o = r * cols;
      const C mu = pmean ? pmean[r] : C(0), rs = prstd[r];
      C sum_g = 0, sum_gx = 0;  // sum g, sum g * xhat
      for (int64_t c = 0; c < cols; ++c) {
        const C g = load(pdy[o + c]) * load(pw[c]);
        sum_g += g;
        sum_gx += g * ((load(px[o + c]) - mu) * rs);
      }
      const C mean_g = pmean ? sum_g / n : C(0), mean_gx = sum_gx / n;
      for (int64_t c = 0; c < cols; ++c) {
        const C g = load(pdy[o + c]) * load(pw[c]);
        const C xhat = (load(px[o + c]) - mu) * rs;
        pdx[o + c] = store<T>(rs * (g - mean_g - xhat * mean_gx));
      }
    }
  });
}

}  // namespace moecore::ops::cpu
