// The Hopper (sm_90a) grouped GEMM kernel behind GroupedGemmImpl::Hopper (grouped_gemm.h):
// TMA + wgmma, persistent, one launch per GEMM over all experts, reading the experts' row
// offsets from device memory. CUDA builds only; the kernels are in grouped_gemm_hopper.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore::ops::cuda::hopper {

enum class GroupedMode { Forward, Dgrad, Wgrad };

// The forward's tile (rows x columns of the output, grouped_gemm_hopper.cu). Wide128 (128 x 256)
// is the training shapes' tile and the one dgrad and wgrad use; with few rows per expert the
// GEMM reads each weight once and is bound by those bytes, and the narrower tiles give it more
// tiles than SMs and more bytes in flight: Narrow128 (128 x 128), Rows64Wide (64 x 256),
// Rows64Narrow (64 x 128). Auto picks by auto_forward_tile.
enum class ForwardTile { Auto, Wide128, Narrow128, Rows64Wide, Rows64Narrow };
const char* forward_tile_name(ForwardTile t);
// Auto's choice for `rows` rows over `experts` experts' [N, K] weights on a GPU of `sms` SMs.
ForwardTile auto_forward_tile(int64_t rows, int64_t experts, int64_t n, int sms);

// True when the kernel can run this case: the library was built for sm_90a, the tensors are on
// a compute-capability 9.0 GPU, contiguous, inputs bf16, every dimension non-zero, last
// dimensions multiples of 8 and base addresses 16-byte aligned (TMA), 1..1024 experts. Shapes
// and output dtypes are the caller's to check (grouped_gemm.cpp).
bool available(const Tensor& a, const Tensor& b, const Tensor& c, int64_t experts);

// One launch on `stream`. offsets: device int32 [experts + 1], offsets[e] = first row of expert
// e in the permuted buffer, offsets[experts] = its row count (a.size(0) for forward and dgrad).
//   Forward  a = x [rows, K],    b = w [E, N, K],  c = out [rows, N] (bf16)
//   Dgrad    a = dout [rows, N], b = w [E, N, K],  c = dx [rows, K] (bf16)
//   Wgrad    a = dout [rows, N], b = x [rows, K],  c = dw [E, N, K] += (f32 or bf16); with
//            accumulate = false dw = (dw not read; experts without rows get zeros)
// tile: the forward's (the other modes run on Wide128).
void grouped_gemm(GroupedMode mode, const Tensor& a, const Tensor& b, Tensor& c, const int* offsets, int experts,
                  cudaStream_t stream, bool accumulate = true, ForwardTile tile = ForwardTile::Auto);

}  // namespace moecore::ops::cuda::hopper
