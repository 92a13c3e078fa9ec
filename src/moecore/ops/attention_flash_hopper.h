// The Hopper (sm_90a) flash-attention kernels behind the flash path (attention.h) for D = Dv = 128
// and MLA's D = 192 with Dv = 128, forward and backward:
// TMA loads, wgmma with fp32 accumulators, P and dS fed to the next product from registers.
// CUDA builds only; the kernels are in attention_flash_hopper.cu.
#pragma once

#include <cuda_runtime_api.h>

#include "moecore/core/tensor.h"
#include "moecore/ops/attention.h"

namespace moecore::ops::cuda::flash_hopper {

// True when these kernels run this case: the library was built for sm_90a, q is on a
// compute-capability 9.0 GPU, bf16, Dv = 128 with D = 128 or 192, q, k, v (and dout, for the
// backward) contiguous
// with 16-byte aligned bases (outputs are contiguous by the op's checks), and MOECORE_ATTENTION_FLASH_HOPPER is not 0 (read at every
// call; 0 selects the mma.sync kernels of attention_flash_cuda.cu).
bool available(const AttentionDims& d, const Tensor& q, const Tensor& k, const Tensor& v,
               const Tensor* dout = nullptr);

// out, lse as attention_forward (scale c, causal with offset Sk - Sq). One launch on `stream`.
void forward(const Tensor& q, const Tensor& k, const Tensor& v, float scale, Tensor& out, Tensor& lse,
             const AttentionDims& d, cudaStream_t stream);

// dq, dk, dv as attention_backward, given dr = rowsum(dO * O) [B, Hq, Sq] f32. Two launches on
// `stream` (dK/dV per key tile, dQ per query tile). split: P and dS enter their products as
// hi + lo bf16 pairs (as the mma.sync kernels; false rounds them once).
void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& dr,
              const Tensor& dout, float scale, bool split, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionDims& d,
              cudaStream_t stream);

}  // namespace moecore::ops::cuda::flash_hopper
