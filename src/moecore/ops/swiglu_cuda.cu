#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/elementwise_math.h"
#include "moecore/ops/swiglu.h"

namespace moecore::ops::cuda {

namespace {
template <typename T>
__global__ void swiglu_forward_kernel(const T* x, T* y, int64_t rows, int64_t f) {
  const int64_t n = rows * f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / f, c = i % f;
    const float g = load(x[r * 2 * f + c]), u = load(x[r * 2 * f + f + c]);
    y[i] = store<T>(math::activation(Activation::Silu, g) * u);
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* x, const T* dy, T* dx, int64_t rows, int64_t f) {
  const int64_t n = rows * f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / f, c = i % f;
    const float g = load(x[r * 2 * f + c]), u = load(x[r * 2 * f + f + c]), d = load(dy[i]);
    dx[r * 2 * f + c] = store<T>(d * u * math::activation_grad(Activation::Silu, g));
    dx[r * 2 * f + f + c] = store<T>(d * math::activation(Activation::Silu, g));
  }
}
}  // namespace

void swiglu_forward(const Tensor& x, Tensor& y, int64_t rows, int64_t f) {
  if (rows * f == 0) return;
  cudaStream_t s = prepare(x);
  dispatch_cuda_floating(x.dtype(), "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T><<<grid_for(rows * f), 256, 0, s>>>(x.data<T>(), y.data<T>(), rows, f);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx, int64_t rows, int64_t f) {
  if (rows * f == 0) return;
  cudaStream_t s = prepare(x);
  dispatch_cuda_floating(x.dtype(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<grid_for(rows * f), 256, 0, s>>>(x.data<T>(), dy.data<T>(), dx.data<T>(), rows, f);
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
