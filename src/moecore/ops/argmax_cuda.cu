// CUDA argmax over rows (ops/argmax.h): one block per row, each thread the best (value, index)
// of a strided range, then a block reduction that keeps the larger value and, among equal
// values, the smaller index; NaN ranks below every number.
#include "moecore/ops/argmax.h"
#include "moecore/ops/cuda_common.cuh"

namespace moecore::ops::cuda {

namespace {

constexpr int kThreads = 1024;

// True when (v, i) ranks before (bv, bi): larger, or equal and earlier; NaN last.
__device__ __forceinline__ bool better(float v, int64_t i, float bv, int64_t bi) {
  if (v != v) return false;
  if (bv != bv) return true;
  return v > bv || (v == bv && i < bi);
}

__global__ void __launch_bounds__(kThreads) argmax_rows_kernel(const float* x, int32_t* out, int64_t cols) {
  __shared__ float sv[kThreads / 32];
  __shared__ int64_t si[kThreads / 32];
  const float* row = x + blockIdx.x * cols;
  float bv = __int_as_float(0x7fc00000);  // NaN: ranks last
  int64_t bi = cols;
  // Eight loads in flight per thread, then their comparisons (the order does not matter: `better`
  // is a total order).
  for (int64_t c0 = threadIdx.x; c0 < cols; c0 += 8 * int64_t(blockDim.x)) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t c = c0 + j * int64_t(blockDim.x);
      v[j] = c < cols ? row[c] : __int_as_float(0x7fc00000);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t c = c0 + j * int64_t(blockDim.x);
      if (c < cols && better(v[j], c, bv, bi)) {
        bv = v[j];
        bi = c;
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_down_sync(0xffffffffu, bv, o);
    const int64_t i = __shfl_down_sync(0xffffffffu, bi, o);
    if (better(v, i, bv, bi)) {
      bv = v;
      bi = i;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) / 32;
    bv = lane < warps ? sv[lane] : __int_as_float(0x7fc00000);
    bi = lane < warps ? si[lane] : cols;
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_down_sync(0xffffffffu, bv, o);
      const int64_t i = __shfl_down_sync(0xffffffffu, bi, o);
      if (better(v, i, bv, bi)) {
        bv = v;
        bi = i;
      }
    }
    if (lane == 0) out[blockIdx.x] = static_cast<int32_t>(bi < cols ? bi : 0);  // an all-NaN row: 0
  }
}

}  // namespace

void argmax_rows(const Tensor& x, Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0) return;
  cudaStream_t s = prepare(x);
  argmax_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, s>>>(x.data<float>(), out.data<int32_t>(), cols);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace moecore::ops::cuda
