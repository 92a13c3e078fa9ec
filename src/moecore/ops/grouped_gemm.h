// Grouped GEMM over experts: one GEMM per expert on consecutive row groups of a permuted
// buffer (the layout of make_moe_routing: rows_per_group[e] rows of expert e, in expert order).
//
//   forward  out_e [M_e, N] = x_e [M_e, K] @ w_e^T            x [M, K], w [E, N, K], out [M, N]
//   dgrad    dx_e  [M_e, K] = dout_e [M_e, N] @ w_e           dout [M, N], w [E, N, K], dx [M, K]
//   wgrad    dw_e  [N, K]  += dout_e^T @ x_e                  dout [M, N], x [M, K], dw [E, N, K]
// with M = sum_e M_e. forward and dgrad overwrite their outputs; wgrad accumulates (beta = 1).
// dtypes as ops::gemm (src/moecore/ops/gemm.h): f32, f64 CPU-only, bf16 with fp32 accumulation;
// out and dx have the input dtype; dw has the input dtype, or f32 for bf16 inputs (fp32
// accumulation). Experts with zero rows are skipped: their wgrad slice is left unchanged.
// All tensors contiguous, on one device.
//
// Implementations (GroupedGemmImpl):
//   Loop     one ops::gemm (cuBLASLt on CUDA) per non-empty expert on row slices; always
//            used on the CPU.
//   Grouped  CUDA only: one cublasGemmGroupedBatchedEx call over the non-empty experts
//            (grouped_gemm_cuda.cpp), one group of size 1 per expert; per-expert pointers are
//            built on the host from rows_per_group and copied to the device asynchronously.
//            cuBLAS's grouped GEMM takes bf16 -> bf16 and f32 -> f32 (fp32 compute); a
//            combination it refuses (bf16 inputs with an f32 wgrad output, see the .cpp) and
//            a zero reduction dimension fall back to the loop.
//   Hopper   CUDA sm_90a only: our kernel (grouped_gemm_hopper.h: TMA + wgmma, one persistent
//            launch over all experts, the tile schedule built on the GPU from the experts' row
//            offsets) for all three GEMMs; bf16 inputs, last dimensions multiples of 8. Other
//            cases (f32, unaligned shapes, another GPU) fall back to the loop.
//   Mixed    the Hopper kernel for forward and dgrad, the loop for the wgrad (cuBLAS's wgrad
//            is faster at the Mixtral shape, ours at the Qwen3 one: docs/performance.md).
// The choice: set_grouped_gemm_impl(), else the environment
// MOECORE_GROUPED_GEMM=loop|grouped|hopper|mixed, else the default, Mixed (see kDefaultImpl in
// grouped_gemm.cpp for the measurements behind it; bench/bench_grouped_gemm.cpp,
// docs/performance.md "Grouped GEMM").
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::ops {

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& out);
void grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& dx);
void grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows_per_group, Tensor& dw);

enum class GroupedGemmImpl { Loop, Grouped, Hopper, Mixed };
GroupedGemmImpl grouped_gemm_impl();
// For tests and benchmarks (process-wide; overrides MOECORE_GROUPED_GEMM).
void set_grouped_gemm_impl(GroupedGemmImpl impl);
const char* grouped_gemm_impl_name(GroupedGemmImpl impl);

namespace cuda {
// One cublasGemmGroupedBatchedEx call on the current stream, arguments already checked.
// Returns false, having computed nothing, where the grouped API cannot do the case (the
// caller then loops over ops::gemm).
bool grouped_gemm_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& out);
bool grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& dx);
bool grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows_per_group, Tensor& dw);
// True once cuBLAS has refused bf16 inputs with an f32 output (such wgrads then loop).
bool grouped_gemm_bf16_f32_refused();
// The Hopper kernel (grouped_gemm_hopper.h), arguments already checked; false, having computed
// nothing, where it cannot run the case (not an sm_90a build or GPU, not bf16, unaligned).
bool hopper_grouped_gemm_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& out);
bool hopper_grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& dx);
bool hopper_grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows_per_group, Tensor& dw);
}  // namespace cuda

}  // namespace moecore::ops
