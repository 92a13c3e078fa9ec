// Normalisation over the last dimension: RMSNorm and LayerNorm, forward and backward.
//
// x [..., H] is viewed as `rows` rows of H. weight and bias are [H] with x's dtype; y has x's
// shape and dtype. Per row (sums over h < H):
//   RMSNorm    rstd = 1 / sqrt(mean(x^2) + eps)           y = x * rstd * weight
//   LayerNorm  mean = mean(x), var = mean((x - mean)^2)   (biased, as in PyTorch)
//              rstd = 1 / sqrt(var + eps)                 y = (x - mean) * rstd * weight + bias
// Backward, with xhat = (x - mean) * rstd (mean = 0 for RMSNorm) and g = dy * weight:
//   RMSNorm    dx = rstd * (g - xhat * mean(g * xhat))
//   LayerNorm  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   dweight += sum_rows dy * xhat       dbias += sum_rows dy
// dweight and dbias ACCUMULATE (gradient accumulation over micro-batches needs no extra pass).
//
// Dtypes: x, weight, bias, y, dy, dx are f32, bf16 or f64 (CPU only), all the same.
// The saved statistics mean and rstd are [rows] (x's leading shape is accepted too) and
// dweight, dbias are [H]: f32, or f64 when x is f64. Compute is fp32 (f64 for f64).
// CUDA: one warp per row for H <= 256, else one block per row; the weight/bias gradients are
// per-worker partial sums in a [workers, H] f32 buffer (a fixed worker count) added in a fixed
// order, so results are reproducible run to run (no atomics).
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void rmsnorm_forward(const Tensor& x, const Tensor& weight, double eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dweight);
void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, Tensor& y, Tensor& mean,
                       Tensor& rstd);
void layernorm_backward(const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        const Tensor& dy, Tensor& dx, Tensor& dweight, Tensor& dbias);

// Backends: arguments already checked. LayerNorm and RMSNorm share the code: RMSNorm passes
// null for bias, mean and dbias (no centering, no bias).
namespace cpu {
void norm_forward(const Tensor& x, const Tensor& weight, const Tensor* bias, double eps, Tensor& y, Tensor* mean,
                  Tensor& rstd, int64_t rows, int64_t cols);
void norm_backward(const Tensor& x, const Tensor& weight, const Tensor* mean, const Tensor& rstd, const Tensor& dy,
                   Tensor& dx, Tensor& dweight, Tensor* dbias, int64_t rows, int64_t cols);
}  // namespace cpu
namespace cuda {
void norm_forward(const Tensor& x, const Tensor& weight, const Tensor* bias, double eps, Tensor& y, Tensor* mean,
                  Tensor& rstd, int64_t rows, int64_t cols);
void norm_backward(const Tensor& x, const Tensor& weight, const Tensor* mean, const Tensor& rstd, const Tensor& dy,
                   Tensor& dx, Tensor& dweight, Tensor* dbias, int64_t rows, int64_t cols);
}  // namespace cuda

}  // namespace moecore::ops
