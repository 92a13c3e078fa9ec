// CUDA FP8 quantisation: the same codes and factors as the CPU (fp8_quant_cpu.cpp) bit for bit
// (core/float_formats.h conversions, fp8_scale_from_amax with correctly rounded divisions),
// tests/gpu/test_gpu_fp8.cpp holds them equal. Plain kernels, not tuned: one warp per 1x128 tile,
// one block per 128x128 block; the transposed tiles read x with a stride. Also the per-tensor
// scaling state kept on the device (amax, a quantiser reading its scale there, the delayed
// recipe's history and update) and the repacking of block factors for cuBLASLt.
#include <cuda_runtime.h>

#include <cmath>

#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/fp8_quant.h"

namespace moecore::ops::cuda {

namespace {
constexpr int B = static_cast<int>(kFp8BlockSize);

__device__ __forceinline__ float max_nan(float a, float b) { return isnan(a) || isnan(b) ? a + b : fmaxf(a, b); }

__device__ __forceinline__ uint8_t encode(float v, bool e4m3) {
  return e4m3 ? float_to_e4m3_bits(v) : float_to_e5m2_bits(v);
}

template <typename T>
__device__ __forceinline__ float value(const T* x, int64_t i) {
  return static_cast<float>(x[i]);
}

template <typename T>
__global__ void amax_kernel(const T* x, int64_t n, unsigned* out) {
  float m = 0.0f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    m = max_nan(m, fabsf(value(x, i)));
  // |x| bits order like the values; a NaN's bits exceed every finite value's and infinity's
  atomicMax(out, __float_as_uint(m) & 0x7fffffffu);
}

template <typename T>
__global__ void per_tensor_kernel(const T* x, int64_t n, float scale, bool e4m3, uint8_t* q, float* scale_inv) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = __frcp_rn(scale);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    q[i] = encode(value(x, i) * scale, e4m3);
}

// One warp per (output row r, tile t): out row r reads x's row r, or x's column r (transpose).
template <typename T>
__global__ void tiles_kernel(const T* x, int64_t out_rows, int64_t out_cols, int64_t x_cols, bool transpose,
                             bool e4m3, uint8_t* q, float* scale_inv) {
  const int64_t tiles = (out_cols + B - 1) / B;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= out_rows * tiles) return;
  const int64_t r = warp / tiles, t = warp % tiles, c0 = t * B;
  float v[4];
  float m = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t c = c0 + lane + 32 * k;
    v[k] = c < out_cols ? value(x, transpose ? c * x_cols + r : r * x_cols + c) : 0.0f;
    m = max_nan(m, fabsf(v[k]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  const Fp8Format f = e4m3 ? Fp8Format::E4M3 : Fp8Format::E5M2;
  const float scale = fp8_scale_from_amax(m, f, true);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t c = c0 + lane + 32 * k;
    if (c < out_cols) q[r * out_cols + c] = encode(v[k] * scale, e4m3);
  }
  if (lane == 0) scale_inv[r * tiles + t] = __frcp_rn(scale);
}

// One block of 256 threads per 128x128 block: its amax into amax_out (if not null), and (q not
// null) its codes and factor with the scale from given (an amax per block, if not null) or its own.
template <typename T>
__global__ void blocks_kernel(const T* x, int64_t rows, int64_t cols, bool e4m3, const float* given, float* amax_out,
                              uint8_t* q, float* scale_inv) {
  __shared__ float partial[8];
  const int64_t r0 = blockIdx.y * static_cast<int64_t>(B), c0 = blockIdx.x * static_cast<int64_t>(B);
  const int64_t h = min(static_cast<int64_t>(B), rows - r0), w = min(static_cast<int64_t>(B), cols - c0);
  const int64_t block = blockIdx.y * gridDim.x + blockIdx.x;
  float m = 0.0f;
  if (!given || amax_out) {
    for (int64_t i = threadIdx.x; i < h * w; i += blockDim.x) m = max_nan(m, fabsf(value(x, (r0 + i / w) * cols + c0 + i % w)));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0.0f;
    for (int i = 0; i < 8; ++i) m = max_nan(m, partial[i]);
    if (amax_out && threadIdx.x == 0) amax_out[block] = m;
  }
  if (!q) return;
  const float scale = fp8_scale_from_amax(given ? given[block] : m, e4m3 ? Fp8Format::E4M3 : Fp8Format::E5M2, true);
  for (int64_t i = threadIdx.x; i < h * w; i += blockDim.x) {
    const int64_t idx = (r0 + i / w) * cols + c0 + i % w;
    q[idx] = encode(value(x, idx) * scale, e4m3);
  }
  if (threadIdx.x == 0) scale_inv[block] = __frcp_rn(scale);
}

__global__ void transpose_codes_kernel(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[(i % cols) * rows + i / cols] = in[i];
}

__global__ void transpose_factors_kernel(const float* in, int64_t rows, int64_t cols, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[(i % cols) * rows + i / cols] = in[i];
}

__global__ void dequantize_kernel(const uint8_t* q, const float* s, int64_t rows, int64_t cols, int scaling,
                                  int64_t s_cols, bool e4m3, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, kb = (i % cols) / B;
    const float f = scaling == 0 ? s[0] : scaling == 1 ? s[r * s_cols + kb] : s[(r / B) * s_cols + kb];
    out[i] = (e4m3 ? e4m3_bits_to_float(q[i]) : e5m2_bits_to_float(q[i])) * f;
  }
}

// Per tensor with the scale read on the device: an amax (tensorwise) or a stored scale, 0 = 1.
template <typename T>
__global__ void per_tensor_src_kernel(const T* x, int64_t n, const float* src, bool from_amax, bool e4m3,
                                      uint8_t* q, float* scale_inv) {
  const float v = *src;
  const float scale = from_amax ? fp8_scale_from_amax(v, e4m3 ? Fp8Format::E4M3 : Fp8Format::E5M2, false)
                                : (v == 0.0f ? 1.0f : v);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = __frcp_rn(scale);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    q[i] = encode(value(x, i) * scale, e4m3);
}

__global__ void history_newest_kernel(const float* h, int64_t rows, int64_t len, float* out) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r < rows) out[r] = h[r * len];
}

// One thread per row: the host code's arithmetic (correctly rounded divisions), then the roll.
__global__ void delayed_update_kernel(float* h, float* scale, const float* newest, int64_t rows, int64_t len,
                                      float x_w_max, float grad_max, bool compute_max, float margin_pow) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  float* hr = h + r * len;
  hr[0] = newest[r];
  float amax = hr[0];
  if (compute_max)
    for (int64_t i = 1; i < len; ++i) amax = max_nan(amax, hr[i]);
  const float prev = scale[r] == 0.0f ? 1.0f : scale[r];
  const float sf = __fdiv_rn(__fdiv_rn(r % 3 == 2 ? grad_max : x_w_max, amax), margin_pow);
  scale[r] = amax > 0.0f && isfinite(amax) ? sf : prev;
  const float first = hr[0];
  for (int64_t i = 0; i + 1 < len; ++i) hr[i] = hr[i + 1];
  hr[len - 1] = first;
  hr[0] = 0.0f;
}

// cuBLASLt's factor layouts (fp8_gemm_cuda.cpp): tiles [R, KB] -> [KB, ld] (rows contiguous),
// blocks [RB, KB] -> [RB, ld].
__global__ void pack_factors_kernel(const float* s, int64_t sr, int64_t sc, bool tiles, int64_t ld, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < sr * sc;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / sc, k = i % sc;
    out[tiles ? k * ld + r : r * ld + k] = s[i];
  }
}

uint8_t* codes(const Fp8Tensor& t) { return static_cast<uint8_t*>(t.data.data_ptr()); }
bool is_e4m3(const Fp8Tensor& t) { return t.format() == Fp8Format::E4M3; }

template <typename F>
void with_input(const Tensor& x, F&& f) {
  if (x.dtype() == DType::F32) {
    f(x.data<float>());
  } else {
    f(x.data<bf16>());
  }
}
}  // namespace

float amax(const Tensor& x) {
  cudaStream_t s = prepare(x);
  Tensor out = Tensor::zeros({1}, DType::I32, x.device());
  with_input(x, [&](auto* p) {
    amax_kernel<<<grid_for(x.numel()), 256, 0, s>>>(p, x.numel(), static_cast<unsigned*>(out.data_ptr()));
  });
  MC_CUDA_CHECK(cudaGetLastError());
  unsigned bits = 0;
  MC_CUDA_CHECK(cudaMemcpyAsync(&bits, out.data_ptr(), 4, cudaMemcpyDeviceToHost, s));
  count_host_synchronization();  // a host read (the model uses amax_into instead)
  MC_CUDA_CHECK(cudaStreamSynchronize(s));
  return bits_float(bits);
}

void quantize_per_tensor(const Tensor& x, float scale, Fp8Tensor& out) {
  cudaStream_t s = prepare(x);
  with_input(x, [&](auto* p) {
    per_tensor_kernel<<<grid_for(x.numel()), 256, 0, s>>>(p, x.numel(), scale, is_e4m3(out), codes(out),
                                                           out.scale_inv.data<float>());
  });
  MC_CUDA_CHECK(cudaGetLastError());
}

void quantize_tiles(const Tensor& x, bool transpose, Fp8Tensor& out) {
  cudaStream_t s = prepare(x);
  const int64_t warps = out.rows() * out.scale_inv.size(1);
  if (warps == 0) return;
  with_input(x, [&](auto* p) {
    tiles_kernel<<<grid_for(warps * 32), 256, 0, s>>>(p, out.rows(), out.cols(), x.size(1), transpose, is_e4m3(out),
                                                      codes(out), out.scale_inv.data<float>());
  });
  MC_CUDA_CHECK(cudaGetLastError());
}

namespace {
// blocks_kernel over the 128x128 blocks of x (fp8_quant_cpu.cpp's blocks()).
void run_blocks(const Tensor& x, const float* given, float* amax_out, Fp8Tensor* out) {
  cudaStream_t s = prepare(x);
  const dim3 grid(static_cast<unsigned>((x.size(1) + B - 1) / B), static_cast<unsigned>((x.size(0) + B - 1) / B));
  if (grid.x == 0 || grid.y == 0) return;
  with_input(x, [&](auto* p) {
    blocks_kernel<<<grid, 256, 0, s>>>(p, x.size(0), x.size(1), out ? is_e4m3(*out) : true, given, amax_out,
                                       out ? codes(*out) : nullptr, out ? out->scale_inv.data<float>() : nullptr);
  });
  MC_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

void quantize_blocks(const Tensor& x, Fp8Tensor& out) { run_blocks(x, nullptr, nullptr, &out); }
void block_amax(const Tensor& x, Tensor& out) { run_blocks(x, nullptr, out.data<float>(), nullptr); }
void quantize_blocks(const Tensor& x, const Tensor& block_amax, Fp8Tensor& out) {
  run_blocks(x, block_amax.data<float>(), nullptr, &out);
}

void fp8_transpose(const Fp8Tensor& t, Fp8Tensor& out) {
  cudaStream_t s = prepare(t.data);
  const int64_t n = t.rows() * t.cols();
  if (n > 0) transpose_codes_kernel<<<grid_for(n), 256, 0, s>>>(codes(t), t.rows(), t.cols(), codes(out));
  const int64_t sr = t.scaling == Fp8Scaling::PerTensor ? 1 : t.scale_inv.size(0);
  const int64_t sc = t.scaling == Fp8Scaling::PerTensor ? 1 : t.scale_inv.size(1);
  transpose_factors_kernel<<<grid_for(sr * sc), 256, 0, s>>>(t.scale_inv.data<float>(), sr, sc,
                                                             out.scale_inv.data<float>());
  MC_CUDA_CHECK(cudaGetLastError());
}

void dequantize(const Fp8Tensor& t, Tensor& out) {
  cudaStream_t s = prepare(t.data);
  const int64_t n = t.rows() * t.cols();
  if (n == 0) return;
  const int scaling = t.scaling == Fp8Scaling::PerTensor ? 0 : t.scaling == Fp8Scaling::Tile1x128 ? 1 : 2;
  const int64_t s_cols = t.scaling == Fp8Scaling::PerTensor ? 1 : t.scale_inv.size(1);
  dequantize_kernel<<<grid_for(n), 256, 0, s>>>(codes(t), t.scale_inv.data<float>(), t.rows(), t.cols(), scaling,
                                                s_cols, is_e4m3(t), out.data<float>());
  MC_CUDA_CHECK(cudaGetLastError());
}

void amax_into(const Tensor& x, Tensor& out) {
  cudaStream_t s = prepare(x);
  with_input(x, [&](auto* p) {
    amax_kernel<<<grid_for(x.numel()), 256, 0, s>>>(p, x.numel(), static_cast<unsigned*>(out.data_ptr()));
  });
  MC_CUDA_CHECK(cudaGetLastError());
}

void quantize_per_tensor(const Tensor& x, const Tensor& src, bool from_amax, Fp8Tensor& out) {
  cudaStream_t s = prepare(x);
  with_input(x, [&](auto* p) {
    per_tensor_src_kernel<<<grid_for(x.numel()), 256, 0, s>>>(p, x.numel(), src.data<float>(), from_amax,
                                                               is_e4m3(out), codes(out), out.scale_inv.data<float>());
  });
  MC_CUDA_CHECK(cudaGetLastError());
}

// history[row, 0] holds an amax (>= +0 or NaN), so the atomic maximum of the bits of |x| is the
// maximum of the values, a NaN winning (amax_kernel).
void record_amax(const Tensor& x, Tensor& history, int64_t row) {
  cudaStream_t s = prepare(x);
  auto* slot = reinterpret_cast<unsigned*>(history.data<float>() + row * history.size(1));
  with_input(x, [&](auto* p) { amax_kernel<<<grid_for(x.numel()), 256, 0, s>>>(p, x.numel(), slot); });
  MC_CUDA_CHECK(cudaGetLastError());
}

void history_newest(const Tensor& history, Tensor& out) {
  cudaStream_t s = prepare(history);
  const int64_t rows = history.size(0);
  if (rows == 0) return;
  history_newest_kernel<<<grid_for(rows), 256, 0, s>>>(history.data<float>(), rows, history.size(1),
                                                       out.data<float>());
  MC_CUDA_CHECK(cudaGetLastError());
}

void delayed_scaling_update(Tensor& history, Tensor& scale, const Tensor& newest, const DelayedScalingUpdate& u) {
  cudaStream_t s = prepare(history);
  const int64_t rows = history.size(0);
  if (rows == 0) return;
  const float margin_pow = std::ldexp(1.0f, static_cast<int>(u.margin));  // exact: a power of two
  delayed_update_kernel<<<grid_for(rows), 256, 0, s>>>(history.data<float>(), scale.data<float>(),
                                                       newest.data<float>(), rows, history.size(1), u.x_w_fp8_max,
                                                       u.grad_fp8_max, u.amax_compute_max, margin_pow);
  MC_CUDA_CHECK(cudaGetLastError());
}

void pack_cublas_factors(const Fp8Tensor& t, Tensor& packed) {
  cudaStream_t s = prepare(t.data);
  const int64_t sr = t.scale_inv.size(0), sc = t.scale_inv.size(1);
  if (sr * sc == 0) return;
  pack_factors_kernel<<<grid_for(sr * sc), 256, 0, s>>>(t.scale_inv.data<float>(), sr, sc,
                                                        t.scaling == Fp8Scaling::Tile1x128, packed.size(1),
                                                        packed.data<float>());
  MC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moecore::ops::cuda
