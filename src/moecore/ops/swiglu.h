// SwiGLU on a fused fc1 output (Megatron's layout: fc1 produces [gate | up] along the last dim).
//   x [R, 2F] -> y [R, F]:   y[r, i] = silu(x[r, i]) * x[r, F + i]
//   backward: dx[r, i]     = dy[r, i] * x[r, F + i] * silu'(x[r, i])
//             dx[r, F + i] = dy[r, i] * silu(x[r, i])
// Weighted (Megatron's weighted_bias_swiglu: the router probability applied in the expert, not in
// the combine): w [R] (or [R, 1]) one weight per row,
//   y[r, i] = silu(x[r, i]) * x[r, F + i] * w[r]
//   backward: dx = the unweighted backward of dy * w; dw[r] = sum_i dy[r, i] * silu(x[r, i]) * x[r, F + i]
//   (dw overwritten; the sum in fp32, f64 for f64, over i in order on the CPU).
// Dtypes: f32, bf16 (CPU and CUDA), f64 (CPU). Compute in fp32 (f64 for f64); one rounding per
// output. w and dw: f32, f64 for f64 x.
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void swiglu_forward(const Tensor& x, Tensor& y);
void swiglu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
void weighted_swiglu_forward(const Tensor& x, const Tensor& w, Tensor& y);
void weighted_swiglu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw);

// Backends: w undefined = unweighted (dw then unused).
namespace cpu {
void swiglu_forward(const Tensor& x, const Tensor& w, Tensor& y, int64_t rows, int64_t f);
void swiglu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw, int64_t rows,
                     int64_t f);
}  // namespace cpu
namespace cuda {
void swiglu_forward(const Tensor& x, const Tensor& w, Tensor& y, int64_t rows, int64_t f);
void swiglu_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw, int64_t rows,
                     int64_t f);
}  // namespace cuda

}  // namespace moecore::ops
