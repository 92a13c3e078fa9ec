// CUDA AdamW: one grid-stride elementwise kernel (f32); the per-step coefficients (bias
// corrections included) come from the host, the per-element update is adamw.h's adamw_update.
#include "moecore/ops/adamw.h"
#include "moecore/ops/cuda_common.cuh"

namespace moecore::ops::cuda {

namespace {

__global__ void adamw_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, int64_t n, AdamWCoefficients<float> k) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_update<float>(pi, g[i], mi, vi, k);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                const AdamWCoefficients<float>& k) {
  const int64_t n = param.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(param);
  adamw_kernel<<<grid_for(n), 256, 0, s>>>(param.data<float>(), grad.data<float>(), exp_avg.data<float>(),
                                           exp_avg_sq.data<float>(), n, k);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
