// Split fp32 masters into (bf16 high half, int16 remainder) and join them back: elementwise,
// grid-stride (master_split.h has the rule).
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/master_split.h"

namespace moecore::ops::cuda {

namespace {
__global__ void split_kernel(const float* __restrict__ x, uint16_t* __restrict__ h, int16_t* __restrict__ r, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    split_master_value(x[i], h[i], r[i]);
}

__global__ void join_kernel(const uint16_t* __restrict__ h, const int16_t* __restrict__ r, float* __restrict__ x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = join_master_value(h[i], r[i]);
}
}  // namespace

void split_master(const Tensor& master, Tensor& high, Tensor& remainder) {
  const int64_t n = master.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(master);
  split_kernel<<<grid_for(n), 256, 0, s>>>(master.data<float>(), reinterpret_cast<uint16_t*>(high.data<bf16>()),
                                           remainder.data<int16_t>(), n);
  MC_CUDA_CHECK_LAUNCH();
}

void join_master(const Tensor& high, const Tensor& remainder, Tensor& master) {
  const int64_t n = master.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(master);
  join_kernel<<<grid_for(n), 256, 0, s>>>(reinterpret_cast<const uint16_t*>(high.data<bf16>()),
                                          remainder.data<int16_t>(), master.data<float>(), n);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
