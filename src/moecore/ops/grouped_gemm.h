// Grouped GEMM over experts: one GEMM per expert on consecutive row groups of a permuted
// buffer (the layout of make_moe_routing: rows_per_group[e] rows of expert e, in expert order).
//
//   forward  out_e [M_e, N] = x_e [M_e, K] @ w_e^T            x [M, K], w [E, N, K], out [M, N]
//   dgrad    dx_e  [M_e, K] = dout_e [M_e, N] @ w_e           dout [M, N], w [E, N, K], dx [M, K]
//   wgrad    dw_e  [N, K]  += dout_e^T @ x_e                  dout [M, N], x [M, K], dw [E, N, K]
//            (accumulate = false: dw_e = dout_e^T @ x_e, dw's old contents ignored)
// with M = sum_e M_e. forward and dgrad overwrite their outputs; wgrad accumulates (beta = 1)
// unless told to overwrite (the first gradient of a step: no zero-fill and no read of dw).
// dtypes as ops::gemm (src/moecore/ops/gemm.h): f32, f64 CPU-only, bf16 with fp32 accumulation;
// out and dx have the input dtype; dw has the input dtype, or f32 for bf16 inputs (fp32
// accumulation). Experts with zero rows: their wgrad slice is left unchanged when accumulating
// and zeroed when overwriting.
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
//   Auto     by the expert weight's shape: Hopper for all three GEMMs when one expert's matrix
//            (N x K) has fewer than 40M elements, the loop for all three from there (Mixtral-8x7B
//            experts, 58.7M: cuBLAS's large GEMMs are faster there); see grouped_gemm.cpp.
// Few rows (M <= kGroupedGemvMaxRows, bf16, under Auto): the forward runs as a
// grouped matrix-vector product instead (gemv_cuda.cu), which reads each used expert's
// weights once at the copy bandwidth; decoding a token's top-k experts is this case.
// Row counts on the device only (ExpertRows without host counts, e.g. a routing plan made
// without its host copy): the Hopper kernel reads the offsets where the implementation would
// run it for that GEMM, so the call enqueues work and returns without waiting for the GPU;
// anything else (the loop, cuBLAS grouped, a case the kernel declines) first copies the counts
// to the host (one synchronisation) and runs as with host counts. Same results either way.
// grouped_gemm_device_rows(w) says in advance whether all three GEMMs of an expert weight w
// would run without that copy.
// The choice: set_grouped_gemm_impl(), else the environment
// MOECORE_GROUPED_GEMM=auto|loop|grouped|hopper|mixed, else the default, Auto (see kDefaultImpl in
// grouped_gemm.cpp for the measurements behind it; bench/bench_grouped_gemm.cpp,
// docs/performance-log.md "Grouped GEMM").
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::ops {

// Expert e's [N, K] matrix of an [E, N, K] tensor (a view).
Tensor expert_matrix(const Tensor& w, int64_t e);

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& out);
void grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& dx);
void grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows_per_group, Tensor& dw,
                        bool accumulate = true);

// The experts' rows of a permuted buffer: offsets [E + 1] i32 on the tensors' device (expert e
// owns rows [offsets[e], offsets[e + 1]), offsets[E] = the buffer's row count), and the counts
// on the host when they are known there (empty otherwise). At least one of the two is set; when
// both are, they must agree (the host counts are used).
// Preconditions on the offsets (not checked on the GPU, where reading them would wait):
// non-decreasing, offsets[0] = 0, offsets[E] = the buffer's row count; routing plans
// (ops::MoeRouting::row_offsets) satisfy them.
struct ExpertRows {
  ExpertRows() = default;
  ExpertRows(std::vector<int64_t> host_counts, Tensor device_offsets)
      : host(std::move(host_counts)), offsets(std::move(device_offsets)) {}
  std::vector<int64_t> host;
  Tensor offsets;
  // The counts on the host: `host`, else copied from the offsets once (synchronises; later
  // calls on the same ExpertRows reuse the copy).
  const std::vector<int64_t>& counts() const;

 private:
  mutable std::vector<int64_t> copied_;
};
void grouped_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows, Tensor& out);
void grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const ExpertRows& rows, Tensor& dx);
void grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const ExpertRows& rows, Tensor& dw, bool accumulate = true);

enum class GroupedGemmImpl { Loop, Grouped, Hopper, Mixed, Auto };
inline constexpr int64_t kGroupedGemvMaxRows = 8;  // beyond, the Hopper kernel is faster (16 prompts x top-2)
// True when forward, dgrad and wgrad with the expert weight w ([E, N, K]; its gradient in f32 or
// w's dtype) run from device offsets alone under the current implementation (Hopper, or Auto
// below its size limit, on a GPU and shape the kernel takes).
bool grouped_gemm_device_rows(const Tensor& w);
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
bool hopper_grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const std::vector<int64_t>& rows_per_group, Tensor& dw,
                               bool accumulate);
// The same with the offsets [E + 1] i32 already on the device (no upload, no host counts).
bool hopper_grouped_gemm_forward(const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out);
bool hopper_grouped_gemm_dgrad(const Tensor& dout, const Tensor& w, const Tensor& offsets, Tensor& dx);
bool hopper_grouped_gemm_wgrad(const Tensor& dout, const Tensor& x, const Tensor& offsets, Tensor& dw, bool accumulate);
// The forward for at most kGroupedGemvMaxRows rows from device offsets (gemv_cuda.cu);
// false, having computed nothing, where it cannot run the case (not bf16, K not a multiple of 8,
// unaligned, more rows).
bool grouped_gemv_forward(const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out);
// The same from host row counts (the offsets go up through a pinned slot, no synchronisation).
bool grouped_gemv_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows_per_group, Tensor& out);
// Its parts: whether it takes the case, and the launch with the offsets already on the device.
bool grouped_gemv_takes(const Tensor& x, const Tensor& w, const Tensor& out);
void grouped_gemv_launch(const Tensor& x, const Tensor& w, const int32_t* offsets, Tensor& out, void* stream);
// Whether the kernel takes an expert weight w like this one (the checks of hopper::available
// that depend on w alone: build, GPU, dtype, dims, experts).
bool hopper_grouped_gemm_takes(const Tensor& w);
}  // namespace cuda

}  // namespace moecore::ops
