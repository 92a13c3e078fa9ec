#include "moecore/core/philox.h"
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/random.h"

namespace moecore::ops::cuda {

namespace {
template <typename T>
__global__ void fill_random_kernel(bool normal, T* p, int64_t n, uint64_t seed, uint64_t key, double a, double b,
                                   int64_t offset) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t idx = static_cast<uint64_t>(offset + i);
    const float v = normal ? static_cast<float>(normal_scaled(a, b, philox_normal(seed, key, idx)))
                           : uniform_between(static_cast<float>(a), static_cast<float>(b),
                                             philox_uniform(seed, key, idx));
    p[i] = store<T>(v);
  }
}
}  // namespace

void fill_random(bool normal, Tensor& t, uint64_t seed, uint64_t key, double a, double b, int64_t offset) {
  const int64_t n = t.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(t);
  dispatch_cuda_floating(t.dtype(), "fill_random", [&](auto tag) {
    using T = decltype(tag);
    fill_random_kernel<T><<<grid_for(n), 256, 0, s>>>(normal, t.data<T>(), n, seed, key, a, b, offset);
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
