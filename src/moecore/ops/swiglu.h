// SwiGLU on a fused fc1 output (Megatron's layout: fc1 produces [gate | up] along the last dim).
//   x [R, 2F] -> y [R, F]:   y[r, i] = silu(x[r, i]) * x[r, F + i]
//   backward: dx[r, i]     = dy[r, i] * x[r, F + i] * silu'(x[r, i])
//             dx[r, F + i] = dy[r, i] * silu(x[r, i])
// Dtypes: f32, bf16 (CPU and CUDA), f64 (CPU). Compute in fp32 (f64 for f64).
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void swiglu_forward(const Tensor& x, Tensor& y);
void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);

namespace cpu {
void swiglu_forward(const Tensor& x, Tensor& y, int64_t rows, int64_t f);
void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx, int64_t rows, int64_t f);
}  // namespace cpu
namespace cuda {
void swiglu_forward(const Tensor& x, Tensor& y, int64_t rows, int64_t f);
void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx, int64_t rows, int64_t f);
}  // namespace cuda

}  // namespace moecore::ops
