#include <algorithm>
#include <cmath>
#include <limits>

#include "moecore/ops/common.h"
#include "moecore/ops/cross_entropy.h"

namespace moecore::ops::cpu {

namespace {
// First row whose target is >= classes, or -1. Checked before anything is computed.
int64_t first_bad_target(const int32_t* targets, int64_t rows, int64_t classes) {
  for (int64_t r = 0; r < rows; ++r)
    if (targets[r] >= classes) return r;
  return -1;
}
}  // namespace

int64_t cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse, int64_t rows,
                              int64_t classes) {
  const int32_t* tg = targets.data<int32_t>();
  const int64_t bad = first_bad_target(tg, rows, classes);
  if (bad >= 0) return bad;
  dispatch_floating(logits.dtype(), "cross_entropy_forward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;  // also the dtype of loss and lse (float or double)
    const T* px = logits.data<T>();
    C* ploss = loss.data<C>();
    C* plse = lse.data<C>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = px + r * classes;
      C mx = -std::numeric_limits<C>::infinity();
      for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, load(xr[c]));
      // The sum runs in double: V reaches ~152k terms, and this is the reference CUDA is held to.
      double sum = 0;
      for (int64_t c = 0; c < classes; ++c) sum += std::exp(load(xr[c]) - mx);
      const C log_sum = static_cast<C>(std::log(sum));
      plse[r] = mx + log_sum;
      // (max - x_target) + log_sum, not lse - x_target: no cancellation when lse is large.
      ploss[r] = tg[r] < 0 ? C(0) : (mx - load(xr[tg[r]])) + log_sum;
    }
  });
  return -1;
}

int64_t cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& dloss,
                               Tensor& dlogits, int64_t rows, int64_t classes, int64_t vocab_start,
                               int64_t vocab_total) {
  const int32_t* tg = targets.data<int32_t>();
  const int64_t bad = first_bad_target(tg, rows, vocab_total);
  if (bad >= 0) return bad;
  dispatch_floating(logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const T* px = logits.data<T>();
    const C* plse = lse.data<C>();
    const C* pdl = dloss.data<C>();
    T* pdx = dlogits.data<T>();  // may be px: every element is read before it is written
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t o = r * classes;
      const int32_t target = tg[r];
      if (target < 0) {
        for (int64_t c = 0; c < classes; ++c) pdx[o + c] = store<T>(C(0));
        continue;
      }
      const C l = plse[r], g = pdl[r];
      const int64_t local = target - vocab_start;  // outside [0, classes): another part's class
      for (int64_t c = 0; c < classes; ++c) {
        const C p = std::exp(load(px[o + c]) - l);
        pdx[o + c] = store<T>(g * (c == local ? p - C(1) : p));
      }
    }
  });
  return -1;
}

int64_t cross_entropy_part_forward(const Tensor& logits, const Tensor& targets, Tensor& lse_part,
                                   Tensor& target_logit, int64_t rows, int64_t classes, int64_t vocab_start,
                                   int64_t vocab_total) {
  const int32_t* tg = targets.data<int32_t>();
  const int64_t bad = first_bad_target(tg, rows, vocab_total);
  if (bad >= 0) return bad;
  dispatch_floating(logits.dtype(), "cross_entropy_part_forward", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    const T* px = logits.data<T>();
    C* plse = lse_part.data<C>();
    C* ptl = target_logit.data<C>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = px + r * classes;
      C mx = -std::numeric_limits<C>::infinity();
      for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, load(xr[c]));
      double sum = 0;  // in double, as cross_entropy_forward
      for (int64_t c = 0; c < classes; ++c) sum += std::exp(load(xr[c]) - mx);
      plse[r] = mx + static_cast<C>(std::log(sum));
      const int64_t local = static_cast<int64_t>(tg[r]) - vocab_start;
      ptl[r] = tg[r] >= 0 && local >= 0 && local < classes ? load(xr[local]) : C(0);
    }
  });
  return -1;
}

void logsumexp_combine(const Tensor& parts, Tensor& lse, int64_t num_parts, int64_t rows) {
  auto run = [&](auto tag) {
    using C = decltype(tag);
    const C* pp = parts.data<C>();
    C* pl = lse.data<C>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      C mx = -std::numeric_limits<C>::infinity();
      bool nan = false;  // std::max keeps its first argument against a NaN: a NaN part must still make the row NaN
      for (int64_t p = 0; p < num_parts; ++p) {
        nan = nan || std::isnan(pp[p * rows + r]);
        mx = std::max(mx, pp[p * rows + r]);
      }
      if (nan) {
        pl[r] = std::numeric_limits<C>::quiet_NaN();
        continue;
      }
      if (std::isinf(mx)) {  // every part empty (-inf), or an infinite part: the max is the answer
        pl[r] = mx;
        continue;
      }
      double sum = 0;
      for (int64_t p = 0; p < num_parts; ++p) sum += std::exp(static_cast<double>(pp[p * rows + r] - mx));
      pl[r] = mx + static_cast<C>(std::log(sum));
    }
  };
  if (parts.dtype() == DType::F64)
    run(double{});
  else
    run(float{});
}

void cross_entropy_combined_loss(const Tensor& lse, const Tensor& target_logit, const Tensor& targets, Tensor& loss,
                                 int64_t rows) {
  auto run = [&](auto tag) {
    using C = decltype(tag);
    const C* pl = lse.data<C>();
    const C* pt = target_logit.data<C>();
    const int32_t* tg = targets.data<int32_t>();
    C* po = loss.data<C>();
    for (int64_t r = 0; r < rows; ++r) po[r] = tg[r] >= 0 ? pl[r] - pt[r] : C(0);
  };
  if (lse.dtype() == DType::F64)
    run(double{});
  else
    run(float{});
}

}  // namespace moecore::ops::cpu
