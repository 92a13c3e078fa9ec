// CUDA elementwise kernels: grid-stride loops, one element per iteration. They move bytes and
// do little math; vectorised (16-byte) versions belong to the GPU-performance work.
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/elementwise_math.h"

namespace moecore::ops::cuda {

namespace {

template <typename T>
__global__ void fill_kernel(T* p, T v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) p[i] = v;
}

template <typename S, typename D>
__global__ void cast_kernel(const S* s, D* d, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    d[i] = store<D>(load(s[i]));
}

template <typename T>
__global__ void binary_kernel(BinaryOp op, float alpha, const T* a, float beta, const T* b, T* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = store<T>(math::binary<float>(op, alpha, load(a[i]), beta, load(b[i])));
}

template <typename T>
__global__ void activation_kernel(Activation act, const T* x, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = store<T>(math::activation(act, load(x[i])));
}

template <typename T>
__global__ void activation_backward_kernel(Activation act, const T* x, const T* dy, T* dx, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dx[i] = store<T>(load(dy[i]) * math::activation_grad(act, load(x[i])));
}

}  // namespace

void fill(Tensor& t, double value) {
  const int64_t n = t.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(t);
  dispatch_cuda_floating(t.dtype(), "fill", [&](auto tag) {
    using T = decltype(tag);
    fill_kernel<T><<<grid_for(n), 256, 0, s>>>(t.data<T>(), store<T>(static_cast<float>(value)), n);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void cast(const Tensor& src, Tensor& dst) {
  const int64_t n = src.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(src);
  dispatch_cuda_floating(src.dtype(), "cast", [&](auto stag) {
    using S = decltype(stag);
    dispatch_cuda_floating(dst.dtype(), "cast", [&](auto dtag) {
      using D = decltype(dtag);
      cast_kernel<S, D><<<grid_for(n), 256, 0, s>>>(src.data<S>(), dst.data<D>(), n);
    });
  });
  MC_CUDA_CHECK_LAUNCH();
}

void binary(BinaryOp op, float alpha, const Tensor& a, float beta, const Tensor& b, Tensor& out) {
  const int64_t n = a.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(a);
  dispatch_cuda_floating(a.dtype(), "binary", [&](auto tag) {
    using T = decltype(tag);
    binary_kernel<T><<<grid_for(n), 256, 0, s>>>(op, alpha, a.data<T>(), beta, b.data<T>(), out.data<T>(), n);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void activation_forward(Activation act, const Tensor& x, Tensor& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(x);
  dispatch_cuda_floating(x.dtype(), "activation", [&](auto tag) {
    using T = decltype(tag);
    activation_kernel<T><<<grid_for(n), 256, 0, s>>>(act, x.data<T>(), y.data<T>(), n);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void activation_backward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const int64_t n = x.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(x);
  dispatch_cuda_floating(x.dtype(), "activation_backward", [&](auto tag) {
    using T = decltype(tag);
    activation_backward_kernel<T><<<grid_for(n), 256, 0, s>>>(act, x.data<T>(), dy.data<T>(), dx.data<T>(), n);
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
