// Softmax over the last dimension, with its backward.
//   y = exp(x - max x) / sum exp(x - max x)
//   dx = y * (dy - sum(dy * y))
// x, y, dy and dx have one shape and one dtype (f32, f64 CPU-only, bf16); compute in fp32
// (f64 for f64). A row of all -inf gives NaN, as in PyTorch.
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void softmax_forward(const Tensor& x, Tensor& y);
void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx);

namespace cpu {
void softmax_forward(const Tensor& x, Tensor& y, int64_t rows, int64_t cols);
void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx, int64_t rows, int64_t cols);
}  // namespace cpu
namespace cuda {
void softmax_forward(const Tensor& x, Tensor& y, int64_t rows, int64_t cols);
void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx, int64_t rows, int64_t cols);
}  // namespace cuda

}  // namespace moecore::ops
