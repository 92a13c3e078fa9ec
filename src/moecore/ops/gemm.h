// GEMM: C = alpha * op(A) @ op(B) + beta * C on row-major matrices.
//
// op(A) is [M, K]: A is stored [M, K], or [K, M] when trans_a. op(B) is [K, N]: B is stored
// [K, N], or [N, K] when trans_b. C is [M, N]. With beta = 0, C's old contents are ignored
// (NaN included), so C may be uninitialised.
//
// dtypes (A, B -> C)              CPU                          CUDA
//   f32, f32 -> f32               OpenBLAS sgemm               cuBLASLt, fp32 compute (no TF32)
//   f64, f64 -> f64               templated loops (reference)  -
//   bf16, bf16 -> bf16 or f32     fp32 via sgemm, then rounded cuBLASLt, fp32 accumulation
// The bf16 -> f32 form accumulates gradients in fp32 (beta = 1) without a bf16 round trip.
#pragma once

#include "moecore/core/tensor.h"

namespace moecore::ops {

void gemm(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha = 1.0f,
          float beta = 0.0f);

// Row-major GEMM dimensions after checking shapes: op(A) [m, k] @ op(B) [k, n].
struct GemmShape {
  int64_t m, n, k;
};
GemmShape gemm_shape(const Tensor& a, const Tensor& b, const Tensor& c, bool trans_a, bool trans_b);

namespace cpu {
void gemm(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha, float beta);
}
namespace cuda {
void gemm(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha, float beta);
// The cuBLASLt version as major*10000 + minor*100 + patch.
size_t cublaslt_version();
}

}  // namespace moecore::ops
