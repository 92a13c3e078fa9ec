// CUDA SwiGLU. Fast path: when F, the row pitch and the pointers allow it, each thread handles
// one 16-byte pack of the gate half, the matching pack of the up half and of y / dy (8 bf16 or
// 4 f32 elements), so every global access is a 16-byte vector and the row/column split costs one
// division per pack. Otherwise a scalar grid-stride loop. Same arithmetic per element on both
// paths (the weighted backward's row sum dw runs in another order on each).
// Weighted: the forward multiplies by w[r] (null: unweighted); the weighted backward gives each
// row to one warp (lanes stride the row's packs, or elements off the fast path) so that dw[r] is
// a warp sum: the same lane partition and shuffle order every launch, so deterministic.
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/elementwise_math.h"
#include "moecore/ops/swiglu.h"

namespace moecore::ops::cuda {

namespace {
template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / static_cast<int>(sizeof(T));
  T v[N];
};

template <typename T>
__global__ void swiglu_forward_vec_kernel(const T* x, const float* w, T* y, int64_t rows, int64_t f) {
  using P = Pack<T>;
  const int64_t np = f / P::N, n = rows * np;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / np, c = (i - r * np) * P::N;
    const P g = *reinterpret_cast<const P*>(x + r * 2 * f + c);
    const P u = *reinterpret_cast<const P*>(x + r * 2 * f + f + c);
    const float wr = w ? w[r] : 1.0f;
    P o;
#pragma unroll
    for (int j = 0; j < P::N; ++j) {
      float v = math::activation(Activation::Silu, load(g.v[j])) * load(u.v[j]);
      if (w) v *= wr;
      o.v[j] = store<T>(v);
    }
    *reinterpret_cast<P*>(y + r * f + c) = o;
  }
}

template <typename T>
__global__ void swiglu_backward_vec_kernel(const T* x, const T* dy, T* dx, int64_t rows, int64_t f) {
  using P = Pack<T>;
  const int64_t np = f / P::N, n = rows * np;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / np, c = (i - r * np) * P::N;
    const P g = *reinterpret_cast<const P*>(x + r * 2 * f + c);
    const P u = *reinterpret_cast<const P*>(x + r * 2 * f + f + c);
    const P d = *reinterpret_cast<const P*>(dy + r * f + c);
    P dg, du;
#pragma unroll
    for (int j = 0; j < P::N; ++j) {
      const float gv = load(g.v[j]), uv = load(u.v[j]), dv = load(d.v[j]);
      dg.v[j] = store<T>(dv * uv * math::activation_grad(Activation::Silu, gv));
      du.v[j] = store<T>(dv * math::activation(Activation::Silu, gv));
    }
    *reinterpret_cast<P*>(dx + r * 2 * f + c) = dg;
    *reinterpret_cast<P*>(dx + r * 2 * f + f + c) = du;
  }
}

template <typename T>
__global__ void swiglu_forward_kernel(const T* x, const float* w, T* y, int64_t rows, int64_t f) {
  const int64_t n = rows * f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / f, c = i % f;
    const float g = load(x[r * 2 * f + c]), u = load(x[r * 2 * f + f + c]);
    float v = math::activation(Activation::Silu, g) * u;
    if (w) v *= w[r];
    y[i] = store<T>(v);
  }
}

// One element of the weighted backward: the gate and up gradients, and the term of dw's row sum.
struct WeightedGrad {
  float dg, du, dw_term;
};
__device__ __forceinline__ WeightedGrad weighted_grad(float g, float u, float d, float w) {
  const float silu = math::activation(Activation::Silu, g), dd = d * w;
  return {dd * u * math::activation_grad(Activation::Silu, g), dd * silu, silu * u * d};
}

// Weighted backward, one warp per row. kVec: 16-byte packs (lane l takes packs l, l + 32, ...);
// else single elements.
template <typename T, bool kVec>
__global__ void swiglu_backward_weighted_kernel(const T* x, const float* w, const T* dy, T* dx, float* dw,
                                                int64_t rows, int64_t f) {
  using P = Pack<T>;
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5; r < rows; r += warps) {
    const float wr = w[r];
    const T* xg = x + r * 2 * f;
    const T* xu = xg + f;
    const T* d = dy + r * f;
    T* dg = dx + r * 2 * f;
    T* du = dg + f;
    float dot = 0.0f;
    if constexpr (kVec) {
      for (int64_t c = int64_t(lane) * P::N; c < f; c += 32 * P::N) {
        const P g = *reinterpret_cast<const P*>(xg + c), u = *reinterpret_cast<const P*>(xu + c);
        const P dv = *reinterpret_cast<const P*>(d + c);
        P og, ou;
#pragma unroll
        for (int j = 0; j < P::N; ++j) {
          const WeightedGrad e = weighted_grad(load(g.v[j]), load(u.v[j]), load(dv.v[j]), wr);
          dot += e.dw_term;
          og.v[j] = store<T>(e.dg);
          ou.v[j] = store<T>(e.du);
        }
        *reinterpret_cast<P*>(dg + c) = og;
        *reinterpret_cast<P*>(du + c) = ou;
      }
    } else {
      for (int64_t c = lane; c < f; c += 32) {
        const WeightedGrad e = weighted_grad(load(xg[c]), load(xu[c]), load(d[c]), wr);
        dot += e.dw_term;
        dg[c] = store<T>(e.dg);
        du[c] = store<T>(e.du);
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) dw[r] = dot;
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The 16-byte path needs F to be a whole number of packs and 16-byte aligned base pointers (the
// row pitches 2F and F are then multiples of 16 bytes too).
template <typename T>
bool vectorizable(int64_t f, const void* a, const void* b, const void* c = nullptr) {
  return f % Pack<T>::N == 0 && aligned16(a) && aligned16(b) && (c == nullptr || aligned16(c));
}
}  // namespace

void swiglu_forward(const Tensor& x, const Tensor& w, Tensor& y, int64_t rows, int64_t f) {
  if (rows * f == 0) return;
  cudaStream_t s = prepare(x);
  const float* pw = w.defined() ? w.data<float>() : nullptr;
  dispatch_cuda_floating(x.dtype(), "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    if (vectorizable<T>(f, x.data_ptr(), y.data_ptr())) {
      swiglu_forward_vec_kernel<T>
          <<<grid_for(rows * f / Pack<T>::N), 256, 0, s>>>(x.data<T>(), pw, y.data<T>(), rows, f);
    } else {
      swiglu_forward_kernel<T><<<grid_for(rows * f), 256, 0, s>>>(x.data<T>(), pw, y.data<T>(), rows, f);
    }
  });
  MC_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw, int64_t rows,
                     int64_t f) {
  if (rows == 0) return;
  cudaStream_t s = prepare(x);
  if (w.defined() && f == 0) {  // empty rows: their weight gradient is an empty sum
    MC_CUDA_CHECK(cudaMemsetAsync(dw.data_ptr(), 0, dw.nbytes(), s));
    return;
  }
  if (f == 0) return;
  dispatch_cuda_floating(x.dtype(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = vectorizable<T>(f, x.data_ptr(), dy.data_ptr(), dx.data_ptr());
    if (w.defined()) {
      const unsigned blocks = grid_for(rows * 32);
      if (vec) {
        swiglu_backward_weighted_kernel<T, true><<<blocks, 256, 0, s>>>(
            x.data<T>(), w.data<float>(), dy.data<T>(), dx.data<T>(), dw.data<float>(), rows, f);
      } else {
        swiglu_backward_weighted_kernel<T, false><<<blocks, 256, 0, s>>>(
            x.data<T>(), w.data<float>(), dy.data<T>(), dx.data<T>(), dw.data<float>(), rows, f);
      }
    } else if (vec) {
      swiglu_backward_vec_kernel<T><<<grid_for(rows * f / Pack<T>::N), 256, 0, s>>>(x.data<T>(), dy.data<T>(),
                                                                                   dx.data<T>(), rows, f);
    } else {
      swiglu_backward_kernel<T><<<grid_for(rows * f), 256, 0, s>>>(x.data<T>(), dy.data<T>(), dx.data<T>(), rows, f);
    }
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
