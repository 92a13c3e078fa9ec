// CUDA FP8 quantisation: the same codes and factors as the CPU (fp8_quant_cpu.cpp) bit for bit
// (core/float_formats.h conversions, fp8_scale_from_amax with correctly rounded divisions),
// tests/gpu/test_gpu_fp8.cpp holds them equal. The quantisers are written for memory speed:
// vector loads and stores where the tensors are aligned (a scalar path for ragged edges), one warp
// per 1x128 tile, a 128 x 64 block through shared memory for the transposed tiles, one block of
// threads per 128x128 block with the block in registers, one atomic per thread block for an amax,
// and the code transpose through 64 x 64 shared-memory tiles. Also the per-tensor scaling state kept on the
// device (amax, a quantiser reading its scale there, the delayed recipe's history and update) and
// the repacking of block factors for cuBLASLt.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "moecore/ops/cuda_common.cuh"
#include "moecore/ops/fp8_quant.h"

namespace moecore::ops::cuda {

namespace {
constexpr int B = static_cast<int>(kFp8BlockSize);

__device__ __forceinline__ float max_nan(float a, float b) { return isnan(a) || isnan(b) ? a + b : fmaxf(a, b); }

// The codes of (lo, hi) as bytes 0 and 1: core/float_formats.h's conversion (round to nearest
// even, saturating to +-fp8_max, infinities too; a NaN keeps its sign: sign | 0x7f). On compute
// capability 8.9+ a pair of normal floats takes one cvt.rn.satfinite (the software conversion is
// ALU work enough to bound the quantisers); zeros, float subnormals, infinities and NaNs, where the
// hardware's conventions are not the CPU's to rely on, take the software path.
// tests/gpu/test_gpu_fp8.cpp checks every bf16 value and random f32 bit patterns.
__device__ __forceinline__ uint32_t encode_sw(float v, bool e4m3) { return e4m3 ? float_to_e4m3_bits(v) : float_to_e5m2_bits(v); }
__device__ __forceinline__ bool special(float v) {
  const uint32_t e = __float_as_uint(v) & 0x7f800000u;
  return e == 0 || e == 0x7f800000u;
}
__device__ __forceinline__ uint32_t encode2(float lo, float hi, bool e4m3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t pair;
  if (e4m3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(pair) : "f"(lo), "f"(hi));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(pair) : "f"(lo), "f"(hi));
  }
  uint32_t r = pair;
  if (special(lo)) r = (r & 0xff00u) | encode_sw(lo, e4m3);
  if (special(hi)) r = (r & 0x00ffu) | encode_sw(hi, e4m3) << 8;
  return r;
#else
  return encode_sw(lo, e4m3) | encode_sw(hi, e4m3) << 8;
#endif
}
// The code of v * scale. A NaN times the scale is a NaN whose sign the CPU keeps (x86 returns the
// NaN operand) but the GPU's multiply does not (it gives the canonical NaN): a NaN's code is taken
// from v itself.
__device__ __forceinline__ uint32_t encode2_scaled(float lo, float hi, float scale, bool e4m3) {
  uint32_t r = encode2(lo * scale, hi * scale, e4m3);
  if (isnan(lo)) r = (r & 0xff00u) | encode_sw(lo, e4m3);
  if (isnan(hi)) r = (r & 0x00ffu) | encode_sw(hi, e4m3) << 8;
  return r;
}
__device__ __forceinline__ uint8_t encode_scaled(float v, float scale, bool e4m3) {
  return static_cast<uint8_t>(encode2_scaled(v, 0.0f, scale, e4m3));
}

template <typename T>
__device__ __forceinline__ float value(const T* x, int64_t i) {
  return static_cast<float>(x[i]);
}

// Vector loads: kQuantVec consecutive elements of x (16 bytes of bf16, 32 of f32) as floats.
constexpr int kQuantVec = 8;
__device__ __forceinline__ void load8(const bf16* x, float* v) {
  const uint4 u = *reinterpret_cast<const uint4*>(x);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = bits_float(w[i] << 16);
    v[2 * i + 1] = bits_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void load8(const float* x, float* v) {
  const float4 a = *reinterpret_cast<const float4*>(x), b = *reinterpret_cast<const float4*>(x + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
// The codes of v[0..3] * scale as one 4-byte word, of v[0..7] * scale as one 8-byte word (byte i:
// element i).
__device__ __forceinline__ uint32_t encode4(const float* v, float scale, bool e4m3) {
  return encode2_scaled(v[0], v[1], scale, e4m3) | encode2_scaled(v[2], v[3], scale, e4m3) << 16;
}
__device__ __forceinline__ uint2 encode8(const float* v, float scale, bool e4m3) {
  return make_uint2(encode4(v, scale, e4m3), encode4(v + 4, scale, e4m3));
}
bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The block's max_nan of m, in every thread (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ float block_max_nan(float m) {
  __shared__ float partial[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  __syncthreads();  // partial may still be read by an earlier call
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = m;
  __syncthreads();
  m = 0.0f;
  for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) m = max_nan(m, partial[i]);
  return m;
}

// max |x| into *out (the bits of |x| order like the values; a NaN's bits exceed every finite
// value's and infinity's): each block reduces its share, then one atomic per block. vec: x is
// 16-byte aligned (then the first n / 8 * 8 elements are read as vectors, the rest one by one).
template <typename T>
__global__ void amax_kernel(const T* x, int64_t n, bool vec, unsigned* out) {
  float m = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nv = vec ? n / kQuantVec : 0;
  for (int64_t i = first; i < nv; i += stride) {
    float v[kQuantVec];
    load8(x + i * kQuantVec, v);
#pragma unroll
    for (int k = 0; k < kQuantVec; ++k) m = max_nan(m, fabsf(v[k]));
  }
  for (int64_t i = nv * kQuantVec + first; i < n; i += stride) m = max_nan(m, fabsf(value(x, i)));
  m = block_max_nan(m);
  if (threadIdx.x == 0) atomicMax(out, __float_as_uint(m) & 0x7fffffffu);
}

// Per tensor: codes = sat(x * scale), the scale given (src null) or read on the device from src: an
// amax (tensorwise) or a stored scale, 0 = 1 (delayed). vec: x 16-byte and q 8-byte aligned.
template <typename T>
__global__ void per_tensor_kernel(const T* x, int64_t n, bool vec, float given, const float* src, bool from_amax,
                                  bool e4m3, uint8_t* q, float* scale_inv) {
  float scale = given;
  if (src) {
    const float v = *src;
    scale = from_amax ? fp8_scale_from_amax(v, e4m3 ? Fp8Format::E4M3 : Fp8Format::E5M2, false) : (v == 0.0f ? 1.0f : v);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = __frcp_rn(scale);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nv = vec ? n / kQuantVec : 0;
  for (int64_t i = first; i < nv; i += stride) {
    float v[kQuantVec];
    load8(x + i * kQuantVec, v);
    *reinterpret_cast<uint2*>(q + i * kQuantVec) = encode8(v, scale, e4m3);
  }
  for (int64_t i = nv * kQuantVec + first; i < n; i += stride) q[i] = encode_scaled(value(x, i), scale, e4m3);
}

// 1x128 tiles of x [rows, cols]: one warp per tile, lane l holding columns 4 l .. 4 l + 3 of it.
// vec: cols a multiple of 4, x and q aligned to 4 elements (then each lane's 4 are one vector).
template <typename T>
__global__ void tiles_kernel(const T* x, int64_t rows, int64_t cols, bool vec, bool e4m3, uint8_t* q,
                             float* scale_inv) {
  const int64_t tiles = (cols + B - 1) / B;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows * tiles) return;
  const int64_t r = warp / tiles, c0 = (warp % tiles) * B + 4 * lane;
  const T* xr = x + r * cols;
  float v[4];
  float m = 0.0f;
  const bool whole = vec && c0 + 4 <= cols;  // 4 elements in reach as one vector
  if (whole && sizeof(T) == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(xr + c0);
    v[0] = bits_float(u.x << 16), v[1] = bits_float(u.x & 0xffff0000u);
    v[2] = bits_float(u.y << 16), v[3] = bits_float(u.y & 0xffff0000u);
  } else if (whole) {
    const float4 u = *reinterpret_cast<const float4*>(xr + c0);
    v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = c0 + k < cols ? value(xr, c0 + k) : 0.0f;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) m = max_nan(m, fabsf(v[k]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float scale = fp8_scale_from_amax(m, e4m3 ? Fp8Format::E4M3 : Fp8Format::E5M2, true);
  uint8_t* qr = q + r * cols;
  if (whole) {
    *reinterpret_cast<uint32_t*>(qr + c0) = encode4(v, scale, e4m3);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (c0 + k < cols) qr[c0 + k] = encode_scaled(v[k], scale, e4m3);
  }
  if (lane == 0) scale_inv[r * tiles + warp % tiles] = __frcp_rn(scale);
}

// The 1x128 tiles of x^T (x [rows, cols]; out [cols, rows]): one block of 256 threads per 128
// rows x 64 columns of x, staged in shared memory as floats (read along x's rows); then 4 threads
// per column c (out row c) reduce its 128 values and write 32 consecutive codes each.
constexpr int kTCols = 64;
// vec: cols a multiple of 8 and x 16-byte aligned (then a block's whole 64-column rows are read
// as vectors of 8).
template <typename T>
__global__ void tiles_transposed_kernel(const T* x, int64_t rows, int64_t cols, bool vec, bool e4m3, uint8_t* q,
                                        float* scale_inv) {
  __shared__ float tile[B][kTCols + 1];  // +1: a warp's 8 columns read at once lie in 8 banks
  const int64_t r0 = blockIdx.y * static_cast<int64_t>(B), c0 = blockIdx.x * static_cast<int64_t>(kTCols);
  if (vec && c0 + kTCols <= cols) {
    for (int i = threadIdx.x; i < B * kTCols / kQuantVec; i += blockDim.x) {
      const int r = i / (kTCols / kQuantVec), c = i % (kTCols / kQuantVec) * kQuantVec;
      float v[kQuantVec] = {};
      if (r0 + r < rows) load8(x + (r0 + r) * cols + c0 + c, v);
#pragma unroll
      for (int k = 0; k < kQuantVec; ++k) tile[r][c + k] = v[k];
    }
  } else {
    for (int i = threadIdx.x; i < B * kTCols; i += blockDim.x) {
      const int r = i / kTCols, c = i % kTCols;
      tile[r][c] = r0 + r < rows && c0 + c < cols ? value(x, (r0 + r) * cols + c0 + c) : 0.0f;
    }
  }
  __syncthreads();
  const int c = threadIdx.x / 4, part = threadIdx.x % 4;  // 4 neighbouring lanes share a column
  float m = 0.0f;
#pragma unroll 8
  for (int k = 0; k < 32; ++k) m = max_nan(m, fabsf(tile[part * 32 + k][c]));
  m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 2));
  if (c0 + c >= cols) return;
  const float scale = fp8_scale_from_amax(m, e4m3 ? Fp8Format::E4M3 : Fp8Format::E5M2, true);
  uint8_t* qr = q + (c0 + c) * rows + r0 + part * 32;
  const int64_t n = min(static_cast<int64_t>(32), rows - r0 - part * 32);
  if (n == 32 && rows % 16 == 0) {
    uint32_t w[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float v[4] = {tile[part * 32 + 4 * k][c], tile[part * 32 + 4 * k + 1][c], tile[part * 32 + 4 * k + 2][c],
                          tile[part * 32 + 4 * k + 3][c]};
      w[k] = encode4(v, scale, e4m3);
    }
    reinterpret_cast<uint4*>(qr)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(qr)[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else {
    for (int64_t k = 0; k < n; ++k) qr[k] = encode_scaled(tile[part * 32 + k][c], scale, e4m3);
  }
  if (part == 0) scale_inv[(c0 + c) * gridDim.y + blockIdx.y] = __frcp_rn(scale);
}

// One block of 256 threads per 128x128 block: its amax into amax_out (if not null), and (q not
// null) its codes and factor with the scale from given (an amax per block, if not null) or its own.
// Thread t holds rows t / 16 + 16 i (i < 8) and the 8 columns from 8 (t % 16) of the block in
// registers; vec: cols a multiple of 8 and x 16-byte, q 8-byte aligned (then whole 8-column pieces
// are vector loads and stores).
template <typename T>
__global__ void blocks_kernel(const T* x, int64_t rows, int64_t cols, bool vec, bool e4m3, const float* given,
                              float* amax_out, uint8_t* q, float* scale_inv) {
  const int64_t r0 = blockIdx.y * static_cast<int64_t>(B), c0 = blockIdx.x * static_cast<int64_t>(B);
  const int64_t block = blockIdx.y * gridDim.x + blockIdx.x;
  const int64_t c = c0 + 8 * (threadIdx.x % 16);
  const bool whole = vec && c + 8 <= cols;
  float v[8][8];
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t r = r0 + threadIdx.x / 16 + 16 * i;
    if (whole && r < rows) {
      load8(x + r * cols + c, v[i]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[i][k] = r < rows && c + k < cols ? value(x, r * cols + c + k) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) m = max_nan(m, fabsf(v[i][k]));
  }
  if (!given || amax_out) {
    m = block_max_nan(m);
    if (amax_out && threadIdx.x == 0) amax_out[block] = m;
  }
  if (!q) return;
  const float scale = fp8_scale_from_amax(given ? given[block] : m, e4m3 ? Fp8Format::E4M3 : Fp8Format::E5M2, true);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t r = r0 + threadIdx.x / 16 + 16 * i;
    if (r >= rows) continue;
    if (whole) {
      *reinterpret_cast<uint2*>(q + r * cols + c) = encode8(v[i], scale, e4m3);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (c + k < cols) q[r * cols + c + k] = encode_scaled(v[i][k], scale, e4m3);
    }
  }
  if (threadIdx.x == 0) scale_inv[block] = __frcp_rn(scale);
}

// Codes in [rows, cols] -> out [cols, rows]: one block of 256 threads per 64 x 64 tile through
// shared memory, rows read and written 16 bytes a thread where the tile is whole and both strides
// are multiples of 16 (fast), byte by byte otherwise.
__global__ void transpose_codes_kernel(const uint8_t* in, int64_t rows, int64_t cols, bool fast, uint8_t* out) {
  __shared__ uint8_t tile[64][64 + 16];  // +16 keeps the 16-byte row reads aligned, shifts banks
  const int64_t r0 = blockIdx.y * 64ll, c0 = blockIdx.x * 64ll;
  const bool whole = fast && r0 + 64 <= rows && c0 + 64 <= cols;
  const int t = threadIdx.x;
  if (whole) {
    const int r = t / 4, part = t % 4;  // row r of the tile, bytes 16 part ..
    *reinterpret_cast<uint4*>(&tile[r][16 * part]) = *reinterpret_cast<const uint4*>(in + (r0 + r) * cols + c0 + 16 * part);
  } else {
    for (int i = t; i < 64 * 64; i += blockDim.x) {
      const int r = i / 64, c = i % 64;
      if (r0 + r < rows && c0 + c < cols) tile[r][c] = in[(r0 + r) * cols + c0 + c];
    }
  }
  __syncthreads();
  if (whole) {
    const int c = t / 4, part = t % 4;  // out row c0 + c, its bytes from tile rows 16 part ..
    uint32_t w[4] = {};
#pragma unroll
    for (int k = 0; k < 16; ++k) w[k / 4] |= static_cast<uint32_t>(tile[16 * part + k][c]) << (8 * (k % 4));
    *reinterpret_cast<uint4*>(out + (c0 + c) * rows + r0 + 16 * part) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    for (int i = t; i < 64 * 64; i += blockDim.x) {
      const int c = i / 64, r = i % 64;
      if (r0 + r < rows && c0 + c < cols) out[(c0 + c) * rows + r0 + r] = tile[r][c];
    }
  }
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

namespace {
// amax_kernel over x into the word at out (zeroed or holding an amax already): vectors where x
// is 16-byte aligned, at most 1024 blocks (one atomic each).
void launch_amax(const Tensor& x, unsigned* out, cudaStream_t s) {
  if (x.numel() == 0) return;
  const bool vec = aligned(x.data_ptr(), 16);
  const unsigned grid = std::min(grid_for(vec ? (x.numel() + kQuantVec - 1) / kQuantVec : x.numel()), 1024u);
  with_input(x, [&](auto* p) { amax_kernel<<<grid, 256, 0, s>>>(p, x.numel(), vec, out); });
  MC_CUDA_CHECK(cudaGetLastError());
}

// per_tensor_kernel over x into out (src null: the given scale).
void launch_per_tensor(const Tensor& x, float scale, const float* src, bool from_amax, Fp8Tensor& out,
                       cudaStream_t s) {
  const bool vec = aligned(x.data_ptr(), 16) && aligned(out.data.data_ptr(), 8);
  const unsigned grid = grid_for(vec ? (x.numel() + kQuantVec - 1) / kQuantVec : x.numel());
  with_input(x, [&](auto* p) {
    per_tensor_kernel<<<grid, 256, 0, s>>>(p, x.numel(), vec, scale, src, from_amax, is_e4m3(out), codes(out),
                                           out.scale_inv.data<float>());
  });
  MC_CUDA_CHECK(cudaGetLastError());
}

// blocks_kernel over the 128x128 blocks of x (fp8_quant_cpu.cpp's blocks()).
void run_blocks(const Tensor& x, const float* given, float* amax_out, Fp8Tensor* out) {
  cudaStream_t s = prepare(x);
  const dim3 grid(static_cast<unsigned>((x.size(1) + B - 1) / B), static_cast<unsigned>((x.size(0) + B - 1) / B));
  if (grid.x == 0 || grid.y == 0) return;
  const bool vec = x.size(1) % 8 == 0 && aligned(x.data_ptr(), 16) && (!out || aligned(out->data.data_ptr(), 8));
  with_input(x, [&](auto* p) {
    blocks_kernel<<<grid, 256, 0, s>>>(p, x.size(0), x.size(1), vec, out ? is_e4m3(*out) : true, given, amax_out,
                                       out ? codes(*out) : nullptr, out ? out->scale_inv.data<float>() : nullptr);
  });
  MC_CUDA_CHECK(cudaGetLastError());
}
}  // namespace

float amax(const Tensor& x) {
  cudaStream_t s = prepare(x);
  Tensor out = Tensor::zeros({1}, DType::I32, x.device());
  launch_amax(x, static_cast<unsigned*>(out.data_ptr()), s);
  unsigned bits = 0;
  MC_CUDA_CHECK(cudaMemcpyAsync(&bits, out.data_ptr(), 4, cudaMemcpyDeviceToHost, s));
  count_host_synchronization();  // a host read (the model uses amax_into instead)
  MC_CUDA_CHECK(cudaStreamSynchronize(s));
  return bits_float(bits);
}

void quantize_per_tensor(const Tensor& x, float scale, Fp8Tensor& out) {
  launch_per_tensor(x, scale, nullptr, false, out, prepare(x));
}

void quantize_tiles(const Tensor& x, bool transpose, Fp8Tensor& out) {
  cudaStream_t s = prepare(x);
  if (out.rows() * out.cols() == 0) return;
  const int64_t rows = x.size(0), cols = x.size(1);
  if (transpose) {
    const dim3 grid(static_cast<unsigned>((cols + kTCols - 1) / kTCols), static_cast<unsigned>((rows + B - 1) / B));
    const bool vec = cols % kQuantVec == 0 && aligned(x.data_ptr(), 16);
    with_input(x, [&](auto* p) {
      tiles_transposed_kernel<<<grid, 256, 0, s>>>(p, rows, cols, vec, is_e4m3(out), codes(out),
                                                   out.scale_inv.data<float>());
    });
  } else {
    const int64_t warps = rows * out.scale_inv.size(1);
    const int elem = x.dtype() == DType::F32 ? 4 : 2;
    const bool vec = cols % 4 == 0 && aligned(x.data_ptr(), 4 * elem) && aligned(out.data.data_ptr(), 4);
    with_input(x, [&](auto* p) {
      tiles_kernel<<<static_cast<unsigned>((warps * 32 + 255) / 256), 256, 0, s>>>(p, rows, cols, vec, is_e4m3(out),
                                                                               codes(out), out.scale_inv.data<float>());
    });
  }
  MC_CUDA_CHECK(cudaGetLastError());
}

void quantize_blocks(const Tensor& x, Fp8Tensor& out) { run_blocks(x, nullptr, nullptr, &out); }
void block_amax(const Tensor& x, Tensor& out) { run_blocks(x, nullptr, out.data<float>(), nullptr); }
void quantize_blocks(const Tensor& x, const Tensor& block_amax, Fp8Tensor& out) {
  run_blocks(x, block_amax.data<float>(), nullptr, &out);
}

void fp8_transpose(const Fp8Tensor& t, Fp8Tensor& out) {
  cudaStream_t s = prepare(t.data);
  const int64_t rows = t.rows(), cols = t.cols();
  if (rows * cols > 0) {
    const bool fast = rows % 16 == 0 && cols % 16 == 0 && aligned(codes(t), 16) && aligned(codes(out), 16);
    const dim3 grid(static_cast<unsigned>((cols + 63) / 64), static_cast<unsigned>((rows + 63) / 64));
    transpose_codes_kernel<<<grid, 256, 0, s>>>(codes(t), rows, cols, fast, codes(out));
  }
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

void amax_into(const Tensor& x, Tensor& out) { launch_amax(x, static_cast<unsigned*>(out.data_ptr()), prepare(x)); }

void quantize_per_tensor(const Tensor& x, const Tensor& src, bool from_amax, Fp8Tensor& out) {
  launch_per_tensor(x, 1.0f, src.data<float>(), from_amax, out, prepare(x));
}

// history[row, 0] holds an amax (>= +0 or NaN), so the atomic maximum of the bits of |x| is the
// maximum of the values, a NaN winning (amax_kernel).
void record_amax(const Tensor& x, Tensor& history, int64_t row) {
  launch_amax(x, reinterpret_cast<unsigned*>(history.data<float>() + row * history.size(1)), prepare(x));
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
