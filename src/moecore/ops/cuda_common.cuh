// Helpers for CUDA kernels: launch geometry, the op's stream, warp and block reductions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "moecore/core/cuda_check.h"
#include "moecore/core/tensor.h"

namespace moecore::ops::cuda {

// Makes the tensor's device current and returns its current stream.
inline cudaStream_t prepare(const Tensor& t) {
  MC_CUDA_CHECK(cudaSetDevice(t.device().index));
  return static_cast<cudaStream_t>(current_stream(t.device()).handle());
}

// Grid for a grid-stride loop over n elements: enough blocks to fill the GPU several times.
inline unsigned grid_for(int64_t n, int threads = 256) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

template <typename C>
__device__ __forceinline__ C warp_sum(C v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename C>
__device__ __forceinline__ C warp_max(C v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
template <typename C>
__device__ C block_sum(C v) {
  __shared__ C partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  C r = lane < warps ? partial[lane] : C(0);
  return warp_sum(r);
}

__device__ inline float block_max(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float r = lane < warps ? partial[lane] : -INFINITY;
  return warp_max(r);
}

// Eight consecutive bf16 values as one 16-byte word (p 16-byte aligned: check with
// aligned16), widened to f32 / rounded to nearest even from f32. In a 32-bit word the lower half
// holds the earlier element (little-endian).
__device__ __forceinline__ void load_bf16x8(const bf16* p, float (&x)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    x[2 * j] = __uint_as_float(w[j] << 16);
    x[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ void store_bf16x8(bf16* p, const float (&x)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = static_cast<uint32_t>(bf16(x[2 * j]).bits) | (static_cast<uint32_t>(bf16(x[2 * j + 1]).bits) << 16);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Elementwise kernels move kVec consecutive elements per iteration as one VecPack (vector loads
// and stores) where every pointer is aligned to its pack (packable); the last n % kVec elements,
// and views at odd offsets, go one by one.
constexpr int kVec = 8;
template <typename T>
struct alignas(sizeof(T) * kVec) VecPack {
  T v[kVec];
};

// True when every pointer is aligned for VecPack<T> of its own element type (sizes given).
inline bool packable(std::initializer_list<std::pair<const void*, size_t>> ptrs) {
  for (const auto& [p, elem] : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % (elem * kVec) != 0) return false;
  return true;
}

// The header of a grid-stride loop of i over [0, n).
#define MC_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// Calls f(T{}) for the dtypes the CUDA kernels support.
template <typename F>
void dispatch_cuda_floating(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(bf16{}); return;
    case DType::FP8E4M3: f(fp8e4m3{}); return;
    case DType::FP8E5M2: f(fp8e5m2{}); return;
    default: MC_FAIL(op, ": dtype ", dtype_name(t), " is not supported on CUDA");
  }
}

}  // namespace moecore::ops::cuda
