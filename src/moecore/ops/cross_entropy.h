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
// device-to-host synchronisation per call), then the same Error is raised; inside an
// ops::TargetsValidated scope (ops/common.h: the caller checked the targets on the host) the
// flag is not read and the call does not synchronise.
//
// Vocabulary-parallel (Megatron's vocab_parallel_cross_entropy): a rank holds the logits of
// the classes [vocab_start, vocab_start + V) of vocab_total classes (0 <= vocab_start,
// vocab_start + V <= vocab_total; the defaults vocab_start = 0, vocab_total = -1 mean the
// whole vocabulary, V). Targets are global class ids in [0, vocab_total) or negative.
//   cross_entropy_part_forward(logits [T, V], targets [T], vocab_start, vocab_total,
//                              lse_part [T], target_logit [T]):
//       lse_part_t     = log sum_{j < V} exp(logits[t, j])          (row maximum subtracted)
//       target_logit_t = logits[t, target_t - vocab_start] if target_t is in this part, else 0
//                        (also 0 for ignored targets)
//   logsumexp_combine(parts [P, T], lse [T]):
//       lse_t = log sum_p exp(parts[p, t])                          (maximum over p subtracted)
//   cross_entropy_combined_loss(lse [T], target_logit [T], targets [T], loss [T]):
//       loss_t = lse_t - target_logit_t where target_t >= 0, else 0
//   cross_entropy_backward(logits, targets, lse, dloss, dlogits, vocab_start, vocab_total):
//       with the GLOBAL lse: dlogits[t, j] = dloss_t * (exp(logits[t, j] - lse_t)
//                                                       - [j == target_t - vocab_start])
//       (the one-hot only for targets in this part; rows with target < 0 get 0; in place OK)
// lse_part, target_logit, parts, lse, loss: f32 (f64 for f64 logits; combine and combined_loss
// take f32, or f64 on the CPU). A target >= vocab_total raises the Error above (with
// vocab_total classes) in part_forward and backward.
// The recipe, per rank of a group of P ranks, rank p holding part p:
//   1. cross_entropy_part_forward(my_logits, targets, start, total, lse_part, target_logit)
//   2. all-gather lse_part over the group into parts [P, T] (row p = rank p's lse_part)
//   3. all-reduce (sum) target_logit over the group: each target lies in exactly one part
//   4. logsumexp_combine(parts, lse); cross_entropy_combined_loss(lse, target_logit, targets,
//      loss): every rank then has the whole-vocabulary loss and lse
//   5. backward: cross_entropy_backward(my_logits, targets, lse, dloss, my_dlogits, start,
//      total) with the combined lse (no communication)
// loss = lse - target_logit is a difference of two possibly large numbers (the whole-vocabulary
// forward avoids it); in fp32 its absolute error is ~1e-7 * |lse|.
#pragma once

#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore::ops {

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse);
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& dloss,
                            Tensor& dlogits, int64_t vocab_start = 0, int64_t vocab_total = -1);

// Both in one call, for the whole vocabulary (training's fused output layer without TP):
// cross_entropy_forward, then cross_entropy_backward with that lse (dlogits may be logits).
// The CUDA backend reads each bf16 row from memory once (a second pass re-reads it from L2)
// when V is a multiple of 8 and the rows are 16-byte aligned, else it runs the two kernels;
// its exponentials are the fast hardware ones (__expf: relative error about 1e-6 here, within
// the tolerances the GPU tests hold it to against the CPU op).
void cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, const Tensor& dloss, Tensor& loss,
                                    Tensor& lse, Tensor& dlogits);

void cross_entropy_part_forward(const Tensor& logits, const Tensor& targets, int64_t vocab_start,
                                int64_t vocab_total, Tensor& lse_part, Tensor& target_logit);
void logsumexp_combine(const Tensor& parts, Tensor& lse);
void cross_entropy_combined_loss(const Tensor& lse, const Tensor& target_logit, const Tensor& targets, Tensor& loss);

// Backends trust their arguments, except for target values: they return the first row whose
// target is >= V (>= vocab_total for the part functions; the dispatcher raises the Error), or
// -1 when every target is valid. `classes` is the V of the logits held.
namespace cpu {
int64_t cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse, int64_t rows,
                              int64_t classes);
int64_t cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& dloss,
                               Tensor& dlogits, int64_t rows, int64_t classes, int64_t vocab_start,
                               int64_t vocab_total);
int64_t cross_entropy_part_forward(const Tensor& logits, const Tensor& targets, Tensor& lse_part,
                                   Tensor& target_logit, int64_t rows, int64_t classes, int64_t vocab_start,
                                   int64_t vocab_total);
void logsumexp_combine(const Tensor& parts, Tensor& lse, int64_t num_parts, int64_t rows);
void cross_entropy_combined_loss(const Tensor& lse, const Tensor& target_logit, const Tensor& targets, Tensor& loss,
                                 int64_t rows);
}  // namespace cpu
namespace cuda {
int64_t cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets, const Tensor& dloss, Tensor& loss,
                                       Tensor& lse, Tensor& dlogits, int64_t rows, int64_t classes);
int64_t cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& loss, Tensor& lse, int64_t rows,
                              int64_t classes);
int64_t cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& dloss,
                               Tensor& dlogits, int64_t rows, int64_t classes, int64_t vocab_start,
                               int64_t vocab_total);
int64_t cross_entropy_part_forward(const Tensor& logits, const Tensor& targets, Tensor& lse_part,
                                   Tensor& target_logit, int64_t rows, int64_t classes, int64_t vocab_start,
                                   int64_t vocab_total);
void logsumexp_combine(const Tensor& parts, Tensor& lse, int64_t num_parts, int64_t rows);
void cross_entropy_combined_loss(const Tensor& lse, const Tensor& target_logit, const Tensor& targets, Tensor& loss,
                                 int64_t rows);
}  // namespace cuda

}  // namespace moecore::ops
