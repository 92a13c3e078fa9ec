// CUDA elementwise kernels: grid-stride loops. Where every pointer is aligned to a pack of 8
// elements (16 bytes in bf16, 32 in f32) a thread moves whole packs (vector loads and stores)
// and the last n % 8 elements run one by one; otherwise (views at odd offsets) one element per
// iteration. The per-element function is the same either way (identical results).
#include <cstdint>
#include <initializer_list>

#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/elementwise_math.h"

namespace moecore::ops::cuda {

namespace {

template <typename T>
__global__ void fill_kernel(T* p, T v, int64_t n) {
  MC_GRID_STRIDE(i, n) p[i] = v;
}

template <typename T>
__global__ void fill_vec_kernel(T* p, T v, int64_t n) {
  VecPack<T> pv;
#pragma unroll
  for (int j = 0; j < kVec; ++j) pv.v[j] = v;
  const int64_t packs = n / kVec;
  MC_GRID_STRIDE(i, packs) reinterpret_cast<VecPack<T>*>(p)[i] = pv;
  MC_GRID_STRIDE(i, n - packs * kVec) p[packs * kVec + i] = v;
}

template <typename S, typename D>
__global__ void cast_kernel(const S* s, D* d, int64_t n) {
  MC_GRID_STRIDE(i, n) d[i] = store<D>(load(s[i]));
}

template <typename S, typename D>
__global__ void cast_vec_kernel(const S* s, D* d, int64_t n) {
  const int64_t packs = n / kVec;
  MC_GRID_STRIDE(i, packs) {
    const VecPack<S> in = reinterpret_cast<const VecPack<S>*>(s)[i];
    VecPack<D> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = store<D>(load(in.v[j]));
    reinterpret_cast<VecPack<D>*>(d)[i] = out;
  }
  MC_GRID_STRIDE(i, n - packs * kVec) d[packs * kVec + i] = store<D>(load(s[packs * kVec + i]));
}

template <typename T>
__global__ void binary_kernel(BinaryOp op, float alpha, const T* a, float beta, const T* b, T* out, int64_t n) {
  MC_GRID_STRIDE(i, n) out[i] = store<T>(math::binary<float>(op, alpha, load(a[i]), beta, load(b[i])));
}

template <typename T>
__global__ void binary_vec_kernel(BinaryOp op, float alpha, const T* a, float beta, const T* b, T* out, int64_t n) {
  const int64_t packs = n / kVec;
  MC_GRID_STRIDE(i, packs) {
    const VecPack<T> x = reinterpret_cast<const VecPack<T>*>(a)[i], y = reinterpret_cast<const VecPack<T>*>(b)[i];
    VecPack<T> r;
#pragma unroll
    for (int j = 0; j < kVec; ++j) r.v[j] = store<T>(math::binary<float>(op, alpha, load(x.v[j]), beta, load(y.v[j])));
    reinterpret_cast<VecPack<T>*>(out)[i] = r;
  }
  const int64_t t0 = packs * kVec;
  MC_GRID_STRIDE(i, n - t0) out[t0 + i] = store<T>(math::binary<float>(op, alpha, load(a[t0 + i]), beta, load(b[t0 + i])));
}

template <typename T>
__global__ void activation_kernel(Activation act, const T* x, T* y, int64_t n) {
  MC_GRID_STRIDE(i, n) y[i] = store<T>(math::activation(act, load(x[i])));
}

template <typename T>
__global__ void activation_vec_kernel(Activation act, const T* x, T* y, int64_t n) {
  const int64_t packs = n / kVec;
  MC_GRID_STRIDE(i, packs) {
    const VecPack<T> in = reinterpret_cast<const VecPack<T>*>(x)[i];
    VecPack<T> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = store<T>(math::activation(act, load(in.v[j])));
    reinterpret_cast<VecPack<T>*>(y)[i] = out;
  }
  const int64_t t0 = packs * kVec;
  MC_GRID_STRIDE(i, n - t0) y[t0 + i] = store<T>(math::activation(act, load(x[t0 + i])));
}

template <typename T>
__global__ void activation_backward_kernel(Activation act, const T* x, const T* dy, T* dx, int64_t n) {
  MC_GRID_STRIDE(i, n) dx[i] = store<T>(load(dy[i]) * math::activation_grad(act, load(x[i])));
}

template <typename T>
__global__ void activation_backward_vec_kernel(Activation act, const T* x, const T* dy, T* dx, int64_t n) {
  const int64_t packs = n / kVec;
  MC_GRID_STRIDE(i, packs) {
    const VecPack<T> xv = reinterpret_cast<const VecPack<T>*>(x)[i], gv = reinterpret_cast<const VecPack<T>*>(dy)[i];
    VecPack<T> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = store<T>(load(gv.v[j]) * math::activation_grad(act, load(xv.v[j])));
    reinterpret_cast<VecPack<T>*>(dx)[i] = out;
  }
  const int64_t t0 = packs * kVec;
  MC_GRID_STRIDE(i, n - t0) dx[t0 + i] = store<T>(load(dy[t0 + i]) * math::activation_grad(act, load(x[t0 + i])));
}

// Blocks for a pack-wise loop over n elements (at least one block for the tail).
unsigned vec_grid(int64_t n) { return grid_for(n / kVec > 0 ? n / kVec : 1); }

}  // namespace

void fill(Tensor& t, double value) {
  const int64_t n = t.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(t);
  if (t.dtype() == DType::F64) {  // f64 state (step counters, MoE statistics): the value as given, not via float
    fill_kernel<double><<<grid_for(n), 256, 0, s>>>(t.data<double>(), value, n);
    MC_CUDA_CHECK_LAUNCH();
    return;
  }
  dispatch_cuda_floating(t.dtype(), "fill", [&](auto tag) {
    using T = decltype(tag);
    if (packable({{t.data_ptr(), sizeof(T)}})) {
      fill_vec_kernel<T><<<vec_grid(n), 256, 0, s>>>(t.data<T>(), store<T>(static_cast<float>(value)), n);
    } else {
      fill_kernel<T><<<grid_for(n), 256, 0, s>>>(t.data<T>(), store<T>(static_cast<float>(value)), n);
    }
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
      if (packable({{src.data_ptr(), sizeof(S)}, {dst.data_ptr(), sizeof(D)}})) {
        cast_vec_kernel<S, D><<<vec_grid(n), 256, 0, s>>>(src.data<S>(), dst.data<D>(), n);
      } else {
        cast_kernel<S, D><<<grid_for(n), 256, 0, s>>>(src.data<S>(), dst.data<D>(), n);
      }
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
    if (packable({{a.data_ptr(), sizeof(T)}, {b.data_ptr(), sizeof(T)}, {out.data_ptr(), sizeof(T)}})) {
      binary_vec_kernel<T><<<vec_grid(n), 256, 0, s>>>(op, alpha, a.data<T>(), beta, b.data<T>(), out.data<T>(), n);
    } else {
      binary_kernel<T><<<grid_for(n), 256, 0, s>>>(op, alpha, a.data<T>(), beta, b.data<T>(), out.data<T>(), n);
    }
  });
  MC_CUDA_CHECK_LAUNCH();
}

void activation_forward(Activation act, const Tensor& x, Tensor& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(x);
  dispatch_cuda_floating(x.dtype(), "activation", [&](auto tag) {
    using T = decltype(tag);
    if (packable({{x.data_ptr(), sizeof(T)}, {y.data_ptr(), sizeof(T)}})) {
      activation_vec_kernel<T><<<vec_grid(n), 256, 0, s>>>(act, x.data<T>(), y.data<T>(), n);
    } else {
      activation_kernel<T><<<grid_for(n), 256, 0, s>>>(act, x.data<T>(), y.data<T>(), n);
    }
  });
  MC_CUDA_CHECK_LAUNCH();
}

void activation_backward(Activation act, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const int64_t n = x.numel();
  if (n == 0) return;
  cudaStream_t s = prepare(x);
  dispatch_cuda_floating(x.dtype(), "activation_backward", [&](auto tag) {
    using T = decltype(tag);
    if (packable({{x.data_ptr(), sizeof(T)}, {dy.data_ptr(), sizeof(T)}, {dx.data_ptr(), sizeof(T)}})) {
      activation_backward_vec_kernel<T><<<vec_grid(n), 256, 0, s>>>(act, x.data<T>(), dy.data<T>(), dx.data<T>(), n);
    } else {
      activation_backward_kernel<T><<<grid_for(n), 256, 0, s>>>(act, x.data<T>(), dy.data<T>(), dx.data<T>(), n);
    }
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
