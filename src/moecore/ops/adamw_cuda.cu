// CUDA AdamW: one grid-stride elementwise kernel (f32 params; moments f32 or bf16); the per-step
// coefficients (bias corrections included) come from the host, the per-element update is
// adamw.h's adamw_update.
#include "moecore/ops/adamw.h"
#include "moecore/ops/cuda_common.cuh"

namespace moecore::ops::cuda {

namespace {

// M and V: float or bf16 (the moments' storage; the update runs in f32 either way).
// w (may be null): the updated param rounded to bf16 (the compute weight), written in the same pass.
template <typename M, typename V>
__global__ void adamw_kernel(float* __restrict__ p, const float* __restrict__ g, M* __restrict__ m,
                             V* __restrict__ v, bf16* __restrict__ w, int64_t n, AdamWCoefficients<float> k) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float pi = p[i], mi = static_cast<float>(m[i]), vi = static_cast<float>(v[i]);
    adamw_update<float>(pi, g[i], mi, vi, k);
    p[i] = pi;
    m[i] = M(mi);
    v[i] = V(vi);
    if (w) w[i] = bf16(pi);
  }
}

template <typename M, typename V>
void launch(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWCoefficients<float>& k,
            bf16* w, int64_t n, cudaStream_t s) {
  adamw_kernel<M, V><<<grid_for(n), 256, 0, s>>>(param.data<float>(), grad.data<float>(), exp_avg.data<M>(),
                                                 exp_avg_sq.data<V>(), w, n, k);
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWCoefficients<float>& k, Tensor* compute_weight) {
  const int64_t n = param.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(param);
  const bool m16 = exp_avg.dtype() == DType::BF16, v16 = exp_avg_sq.dtype() == DType::BF16;
  bf16* w = compute_weight ? compute_weight->data<bf16>() : nullptr;
  if (m16 && v16) launch<bf16, bf16>(param, grad, exp_avg, exp_avg_sq, k, w, n, s);
  else if (m16) launch<bf16, float>(param, grad, exp_avg, exp_avg_sq, k, w, n, s);
  else if (v16) launch<float, bf16>(param, grad, exp_avg, exp_avg_sq, k, w, n, s);
  else launch<float, float>(param, grad, exp_avg, exp_avg_sq, k, w, n, s);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
