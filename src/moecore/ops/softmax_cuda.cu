// CUDA softmax: one 256-thread block per row. Forward reads the row three times (max, sum,
// write), which stays in L1/L2 for rows up to the vocabulary sizes we use; backward twice.
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/softmax.h"

namespace moecore::ops::cuda {

namespace {

template <typename T>
__global__ void softmax_forward_kernel(const T* x, T* y, int64_t cols) {
  const T* xr = x + blockIdx.x * cols;
  T* yr = y + blockIdx.x * cols;
  float mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) mx = fmaxf(mx, load(xr[c]));
  mx = block_max(mx);
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += expf(load(xr[c]) - mx);
  sum = block_sum(sum);
  const float inv = 1.0f / sum;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = store<T>(expf(load(xr[c]) - mx) * inv);
}

template <typename T>
__global__ void softmax_backward_kernel(const T* y, const T* dy, T* dx, int64_t cols) {
  const int64_t o = blockIdx.x * cols;
  float dot = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dot += load(dy[o + c]) * load(y[o + c]);
  dot = block_sum(dot);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dx[o + c] = store<T>(load(y[o + c]) * (load(dy[o + c]) - dot));
}

}  // namespace

void softmax_forward(const Tensor& x, Tensor& y, int64_t rows, int64_t cols) {
  if (rows == 0) return;
  cudaStream_t s = prepare(x);
  dispatch_cuda_floating(x.dtype(), "softmax_forward", [&](auto tag) {
    using T = decltype(tag);
    softmax_forward_kernel<T><<<static_cast<unsigned>(rows), 256, 0, s>>>(x.data<T>(), y.data<T>(), cols);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx, int64_t rows, int64_t cols) {
  if (rows == 0) return;
  cudaStream_t s = prepare(y);
  dispatch_cuda_floating(y.dtype(), "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    softmax_backward_kernel<T><<<static_cast<unsigned>(rows), 256, 0, s>>>(y.data<T>(), dy.data<T>(), dx.data<T>(), cols);
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
