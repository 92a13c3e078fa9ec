#include "moecore/ops/adamw.h"

namespace moecore::ops::cpu {

namespace {
template <typename C>
void update_all(C* p, const C* g, C* m, C* v, int64_t n, const AdamWCoefficients<C>& k) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) adamw_update<C>(p[i], g[i], m[i], v[i], k);
}
}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWCoefficients<double>& k64, const AdamWCoefficients<float>& k32) {
  const int64_t n = param.numel();
  if (param.dtype() == DType::F64) {
    update_all<double>(param.data<double>(), grad.data<double>(), exp_avg.data<double>(), exp_avg_sq.data<double>(),
                       n, k64);
  } else {
    update_all<float>(param.data<float>(), grad.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>(), n,
                      k32);
  }
}

}  // namespace moecore::ops::cpu
