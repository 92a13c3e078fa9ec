// Reductions. x is viewed as [R, C] with C the last dimension.
//   sum_last_dim     out[r] = sum_c x[r, c]        out shape: x's without the last dim
//   max_last_dim     out[r] = max_c x[r, c]
//   sum_leading_dims out[c] = sum_r x[r, c]        out shape: [C] (bias gradients)
//   sum_all          out[0] = sum x                out shape: [1]
//   sum_squares      out[0] = sum x^2              out shape: [1] (norms)
// out has x's dtype, or f32 for bf16/fp8 inputs (accumulated sums in fp32).
// The CPU accumulates in double; CUDA in fp32 with fixed tree orders, so a result is the same
// from run to run (no atomics).
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void sum_last_dim(const Tensor& x, Tensor& out);
void max_last_dim(const Tensor& x, Tensor& out);
void sum_leading_dims(const Tensor& x, Tensor& out);
void sum_all(const Tensor& x, Tensor& out);
void sum_squares(const Tensor& x, Tensor& out);

enum class RowReduce { Sum, Max };
enum class TotalReduce { Sum, SumSquares };

namespace cpu {
void reduce_rows(RowReduce kind, const Tensor& x, Tensor& out, int64_t rows, int64_t cols);
void sum_columns(const Tensor& x, Tensor& out, int64_t rows, int64_t cols);
void reduce_total(TotalReduce kind, const Tensor& x, Tensor& out);
}  // namespace cpu
namespace cuda {
void reduce_rows(RowReduce kind, const Tensor& x, Tensor& out, int64_t rows, int64_t cols);
void sum_columns(const Tensor& x, Tensor& out, int64_t rows, int64_t cols);
void reduce_total(TotalReduce kind, const Tensor& x, Tensor& out);
}  // namespace cuda

}  // namespace moecore::ops
