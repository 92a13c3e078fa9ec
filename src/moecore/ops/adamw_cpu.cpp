#include "moecore/ops/adamw.h"
#include "moecore/ops/master_split.h"

namespace moecore::ops::cpu {

namespace {
template <typename C>
void update_all(C* p, const C* g, C* m, C* v, int64_t n, const AdamWCoefficients<C>& k, bool parallel) {
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t i = 0; i < n; ++i) adamw_update<C>(p[i], g[i], m[i], v[i], k);
}

// f32 parameters with moments stored as M / V (float or bf16): as the CUDA kernel.
// w (may be null): the updated param rounded to bf16, as the CUDA kernel writes it.
template <typename M, typename V>
void update_mixed(float* p, const float* g, M* m, V* v, bf16* w, int64_t n, const AdamWCoefficients<float>& k,
                  bool parallel) {
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t i = 0; i < n; ++i) {
    float mi = static_cast<float>(m[i]), vi = static_cast<float>(v[i]);
    adamw_update<float>(p[i], g[i], mi, vi, k);
    m[i] = M(mi);
    v[i] = V(vi);
    if (w) w[i] = bf16(p[i]);
  }
}

template <typename M, typename V>
void update_split(bf16* h, int16_t* r, const float* g, M* m, V* v, int64_t n, const AdamWCoefficients<float>& k) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float p = join_master_value(h[i].bits, r[i]), mi = static_cast<float>(m[i]), vi = static_cast<float>(v[i]);
    adamw_update<float>(p, g[i], mi, vi, k);
    split_master_value(p, h[i].bits, r[i]);
    m[i] = M(mi);
    v[i] = V(vi);
  }
}
}  // namespace

void adamw_step_split(Tensor& high, Tensor& remainder, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                      const AdamWCoefficients<float>& k) {
  const int64_t n = high.numel();
  bf16* h = high.data<bf16>();
  int16_t* r = remainder.data<int16_t>();
  const float* g = grad.data<float>();
  const bool m16 = exp_avg.dtype() == DType::BF16, v16 = exp_avg_sq.dtype() == DType::BF16;
  if (m16 && v16) update_split(h, r, g, exp_avg.data<bf16>(), exp_avg_sq.data<bf16>(), n, k);
  else if (m16) update_split(h, r, g, exp_avg.data<bf16>(), exp_avg_sq.data<float>(), n, k);
  else if (v16) update_split(h, r, g, exp_avg.data<float>(), exp_avg_sq.data<bf16>(), n, k);
  else update_split(h, r, g, exp_avg.data<float>(), exp_avg_sq.data<float>(), n, k);
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWCoefficients<double>& k64, const AdamWCoefficients<float>& k32, Tensor* compute_weight,
                bool parallel) {
  const int64_t n = param.numel();
  if (param.dtype() == DType::F64) {
    update_all<double>(param.data<double>(), grad.data<double>(), exp_avg.data<double>(), exp_avg_sq.data<double>(),
                       n, k64, parallel);
  } else if (exp_avg.dtype() == DType::BF16 || exp_avg_sq.dtype() == DType::BF16 || compute_weight) {
    float* p = param.data<float>();
    const float* g = grad.data<float>();
    bf16* w = compute_weight ? compute_weight->data<bf16>() : nullptr;
    const bool m16 = exp_avg.dtype() == DType::BF16, v16 = exp_avg_sq.dtype() == DType::BF16;
    if (m16 && v16) update_mixed(p, g, exp_avg.data<bf16>(), exp_avg_sq.data<bf16>(), w, n, k32, parallel);
    else if (m16) update_mixed(p, g, exp_avg.data<bf16>(), exp_avg_sq.data<float>(), w, n, k32, parallel);
    else if (v16) update_mixed(p, g, exp_avg.data<float>(), exp_avg_sq.data<bf16>(), w, n, k32, parallel);
    else update_mixed(p, g, exp_avg.data<float>(), exp_avg_sq.data<float>(), w, n, k32, parallel);
  } else {
    update_all<float>(param.data<float>(), grad.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>(), n,
                      k32, parallel);
  }
}

}  // namespace moecore::ops::cpu
