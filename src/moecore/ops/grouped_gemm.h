// Grouped GEMM over experts: one GEMM per expert on consecutive row groups of a permuted
// buffer (the layout of make_moe_routing: rows_per_group[e] rows of expert e, in expert order).
//
//   forward  out_e [M_e, N] = x_e [M_e, K] @ w_e^T            x [M, K], w [E, N, K], out [M, N]
//   dgrad    dx_e  [M_e, K] = dout_e [M_e, N] @ w_e           dout [M, N], w [E, N, K], dx [M, K]
//   wgrad    dw_e  [N, K]  += dout_e^T @ x_e                  dout [M, N], x [M, K], dw [E, N, K]
// with M = sum_e M_e. forward and dgrad overwrite their outputs; wgrad accumulates (beta = 1).
// Each expert's GEMM is ops::gemm on row slices (src/moecore/ops/gemm.h), which picks the
// backend by device: dtypes as there (f32, f64 CPU-only, bf16 with fp32 accumulation; out and
// dx have the input dtype; dw has the input dtype, or f32 for bf16 inputs (fp32 accumulation).
// Experts with zero rows are skipped: their wgrad slice is left unchanged.
// All tensors contiguous, on one device.
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::ops {

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& out);
void grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& dx);
void grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows_per_group, Tensor& dw);

}  // namespace moecore::ops
