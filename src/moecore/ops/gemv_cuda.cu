// The grouped GEMM's forward with a handful of rows (decoding a token's top-k experts) as
// matrix-vector products: out_e [M_e, N] = x_e [M_e, K] @ w_e^T, w [E, N, K], the experts' row
// offsets read on the device, M <= kGroupedGemvMaxRows; bf16, fp32 accumulation, each output
// rounded once. (For one dense weight cuBLASLt's own small-M kernels are faster, so ops::gemm
// keeps them.) At so few rows the GEMM reads each weight once and does
// almost no arithmetic, so it is bound by the weights' bytes: block (c, e) computes columns
// [c * kColsPerBlock, ...) of expert e (an empty expert's blocks return at once); each warp takes
// kColsPerWarp weight rows, read 16 bytes per lane, coalesced, several loads in flight, multiplies
// them with the expert's input rows (cached) and sums over the lanes.
#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/grouped_gemm.h"

namespace moecore::ops::cuda {

namespace {

constexpr int kMaxRows = static_cast<int>(kGroupedGemvMaxRows);
constexpr int kThreads = 256, kWarps = kThreads / 32, kColsPerWarp = 2, kColsPerBlock = kWarps * kColsPerWarp;

__global__ void __launch_bounds__(kThreads) grouped_gemv_kernel(const bf16* x, const bf16* w, const int32_t* offsets,
                                                                bf16* out, int64_t N, int64_t K) {
  const int64_t e = blockIdx.y;
  const int begin = offsets[e], rows = offsets[e + 1] - begin;
  if (rows <= 0) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kColsPerBlock + warp * kColsPerWarp;
  if (n0 >= N) return;
  const bf16* we = w + e * N * K;
  const bf16* xe = x + static_cast<int64_t>(begin) * K;
  float acc[kColsPerWarp][kMaxRows] = {};
#pragma unroll 4
  for (int64_t k = lane * 8; k < K; k += 32 * 8) {
    float wv[kColsPerWarp][8];
#pragma unroll
    for (int c = 0; c < kColsPerWarp; ++c) {
      if (n0 + c < N) {
        load_bf16x8(we + (n0 + c) * K + k, wv[c]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) wv[c][j] = 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < rows) {
        float xv[8];
        load_bf16x8(xe + r * K + k, xv);
#pragma unroll
        for (int c = 0; c < kColsPerWarp; ++c)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[c][r] = fmaf(wv[c][j], xv[j], acc[c][r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r >= rows) break;
#pragma unroll
    for (int c = 0; c < kColsPerWarp; ++c) {
      const float s = warp_sum(acc[c][r]);
      if (lane == 0 && n0 + c < N) out[static_cast<int64_t>(begin + r) * N + n0 + c] = bf16(s);
    }
  }
}

}  // namespace

bool grouped_gemv_takes(const Tensor& x, const Tensor& w, const Tensor& out) {
  return x.device().is_cuda() && w.device() == x.device() && out.device() == x.device() && x.is_contiguous() &&
         w.is_contiguous() && out.is_contiguous() && x.dtype() == DType::BF16 &&
         w.dtype() == DType::BF16 && out.dtype() == DType::BF16 && x.size(0) <= kGroupedGemvMaxRows &&
         w.size(2) % 8 == 0 && aligned16(x.data<bf16>()) && aligned16(w.data<bf16>()) && w.size(0) <= 65535;
}

void grouped_gemv_launch(const Tensor& x, const Tensor& w, const int32_t* offsets, Tensor& out, void* stream) {
  const int64_t M = x.size(0), E = w.size(0), N = w.size(1), K = w.size(2);
  if (M == 0 || N == 0) return;
  const dim3 grid(static_cast<unsigned>((N + kColsPerBlock - 1) / kColsPerBlock), static_cast<unsigned>(E));
  grouped_gemv_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      x.data<bf16>(), w.data<bf16>(), offsets, out.data<bf16>(), N, K);
  MC_CUDA_CHECK_LAUNCH();
}

bool grouped_gemv_forward(const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out) {
  if (!grouped_gemv_takes(x, w, out) || offsets.device() != x.device()) return false;
  grouped_gemv_launch(x, w, offsets.data<int32_t>(), out, prepare(x));
  return true;
}

}  // namespace moecore::ops::cuda
