// Cross-entropy loss over a vocabulary, per token, with its backward.
//
// Shapes and dtypes (T tokens, V classes):
//   logits  [T, V]  f32 or bf16 (f64 on the CPU only)
//   targets [T]     i32: a class in [0, V), or negative = ignored (loss 0, no gradient)
//   loss    [T]     f32 (f64 for f64 logits)
//   lse     [T]     f32 (f64 for f64 logits), saved for backward
//   dloss   [T]     f32 (f64 for f64 logits)
//   dlogits [T, V]  logits' dtype; may alias logits (in-place backward saves [T, V] memory)
// Forward:   lse_t  = log sum_j exp(logits[t, j])   (computed with the row maximum subtracted)
//            loss_t = lse_t - logits[t, target_t]           (0 where target_t < 0)
//            evaluated as (max_t - logits[t, target_t]) + log sum_j exp(logits[t, j] - max_t),
//            which avoids the cancellation of lse_t - logits[t, target_t] when both are large
// Backward:  dlogits[t, j] = dloss_t * (exp(logits[t, j] - lse_t) - [j == target_t])
//            (0 on rows whose target is ignored)
// Math is fp32 for f32/bf16 (the CPU sums exponentials in double), f64 for f64. lse is
// computed for every row, ignored ones included.
// A target >= V raises an Error naming the row and the value. The CPU checks before computing;
// CUDA kernels record the first bad row in a device flag that is read after the kernel (one
// device-to-host synchronisation per call), then the same Error is raised.
#pragma once

#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore::ops {

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse);
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& dloss,
                            Tensor& dlogits);

// Backends trust their arguments, except for target values: they return the first row whose
// target is >= V (the dispatcher raises the Error), or -1 when every target is valid.
namespace cpu {
int64_t cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse, int64_t rows,
                              int64_t classes);
int64_t cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& dloss,
                               Tensor& dlogits, int64_t rows, int64_t classes);
}  // namespace cpu
namespace cuda {
int64_t cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse, int64_t rows,
                              int64_t classes);
int64_t cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& dloss,
                               Tensor& dlogits, int64_t rows, int64_t classes);
}  // namespace cuda

}  // namespace moecore::ops
