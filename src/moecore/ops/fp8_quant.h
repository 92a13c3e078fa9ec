// FP8 quantisation and the FP8 GEMM (emulated on the CPU) for FP8 training.
//
// A quantised operand (Fp8Tensor) is a 2-D matrix of fp8 codes (E4M3 or E5M2, core/float_formats.h:
// round to nearest even, saturating) and fp32 dequantisation factors ("scale_inv", Transformer
// Engine's name): x ~= code * scale_inv. Three granularities:
//   PerTensor   one factor [1]                                       tensorwise and delayed recipes
//   Tile1x128   one per row and 128 consecutive columns, [R, ceil(C/128)]   blockwise: activations
//               and gradients (the 128x1 tiles wgrad needs are the 1x128 tiles of the transpose,
//               quantised from the high-precision values: quantize_tiles(x, fmt, true))
//   Block128    one per 128x128 block, [ceil(R/128), ceil(C/128)]  blockwise: weights
//
// How a scale is computed (Transformer Engine's and DeepSeek-V3's convention): the quantiser
// multiplies by scale = fp8_max / amax (amax = max |x| over the tensor, tile or block) and the
// dequantisation factor is scale_inv = 1 / scale (= amax / fp8_max). fp8_scale_from_amax():
//   amax == 0 or not finite  -> scale 1 (nothing to scale; a NaN/Inf reaches the codes instead)
//   fp8_max / amax overflows  -> the largest float
//   power_of_two              -> rounded DOWN to a power of two (2^floor(log2)), so scale_inv
//                                is exact and no value overflows: Transformer Engine's default for
//                                Float8BlockScaling; the blockwise recipe uses it. Tensorwise
//                                (Float8CurrentScaling) and delayed scales are not rounded.
// Values beyond fp8_max * scale_inv saturate to +-fp8_max (448 for E4M3, 57344 for E5M2).
//
// fp8_gemm: C [M, N] = A [M, K] . B [N, K]^T (+ beta C), both operands "K-major" (the TN layout
// Hopper's FP8 tensor cores require; wgrad and dgrad pass transposed copies). The CPU emulates
// what a Hopper kernel computes: for every 128-wide block kb of K (or the whole K when both
// operands are PerTensor) the products of the codes are summed in fp32, P = sum_k a_code b_code,
// and accumulated as acc += P * (sa(m, kb) * sb(n, kb)) in fp32 (DeepSeek's per-block promotion;
// for PerTensor operands: one block, acc = P * (sa * sb), cuBLASLt's A/B scale pointers). C gets
// acc (+ beta C) rounded once into its dtype. The code products are exact in fp32 and the sums
// are sgemm's, so the emulation differs from a GPU only in the summation order. On CUDA the
// quantisers give the CPU's codes and factors bit for bit (fp8_quant_cuda.cu) and fp8_gemm runs
// cuBLASLt's FP8 GEMM (fp8_gemm_cuda.cpp: per-tensor scale pointers, VEC128 / BLK128x128 block
// scaling); tests/gpu/test_gpu_fp8.cpp holds both to the CPU.
// Error bound (tested against fp64 in tests/unit/test_fp8.cpp): |C - A.B^T| <= sum_k |a_k b_k| *
// (2 u + u^2) + fp32 rounding, u = 2^-4 for E4M3 (3 mantissa bits), 2^-3 for E5M2, for operands
// inside the normal range (each factor is one rounding of relative error <= u, saturation aside).
#pragma once

#include <cstdint>

#include "moecore/core/float_formats.h"
#include "moecore/core/tensor.h"

namespace moecore::ops {

enum class Fp8Format { E4M3, E5M2 };
enum class Fp8Scaling { PerTensor, Tile1x128, Block128 };
constexpr int64_t kFp8BlockSize = 128;

struct Fp8Tensor {
  Tensor data;       // [R, C] fp8e4m3 or fp8e5m2
  Tensor scale_inv;  // f32, shape by scaling (above)
  Fp8Scaling scaling = Fp8Scaling::PerTensor;
  int64_t rows() const { return data.size(0); }
  int64_t cols() const { return data.size(1); }
  Fp8Format format() const { return data.dtype() == DType::FP8E5M2 ? Fp8Format::E5M2 : Fp8Format::E4M3; }
};

MC_HD float fp8_max(Fp8Format f) { return f == Fp8Format::E4M3 ? 448.0f : 57344.0f; }
DType fp8_dtype(Fp8Format f);
const char* fp8_format_name(Fp8Format f);  // "e4m3", "e5m2"
// The scale for an amax (above); the same arithmetic on the CPU and in CUDA kernels. Rounding a
// positive normal float down to a power of two clears its mantissa bits.
MC_HD float fp8_scale_from_amax(float amax, Fp8Format f, bool power_of_two) {
  const uint32_t abits = float_bits(amax) & 0x7fffffffu;
  if (!(amax > 0.0f) || abits >= 0x7f800000u) return 1.0f;  // zero, negative, NaN or infinite
#if defined(__CUDA_ARCH__)
  float scale = __fdiv_rn(fp8_max(f), amax);  // correctly rounded, as on the CPU, whatever the flags
#else
  float scale = fp8_max(f) / amax;
#endif
  if ((float_bits(scale) & 0x7fffffffu) >= 0x7f800000u) scale = 3.402823466e38f;  // FLT_MAX
  if (power_of_two) scale = bits_float(float_bits(scale) & 0xff800000u);
  return scale;
}

// max |x| over x (f32 or bf16, any shape, contiguous); NaN if x holds one. Read on the host.
float amax(const Tensor& x);
// x [R, C] (f32 or bf16) with one given scale: codes = sat(x * scale), scale_inv = 1 / scale.
Fp8Tensor quantize_per_tensor(const Tensor& x, float scale, Fp8Format f);
// 1x128 tiles of x [R, C] with power-of-two scales; transpose: the tiles of x^T ([C, R] codes:
// the 128x1 tiles of x along its rows), quantised from x directly.
Fp8Tensor quantize_tiles(const Tensor& x, Fp8Format f, bool transpose = false);
// 128x128 blocks of x [R, C] with power-of-two scales (weights).
Fp8Tensor quantize_blocks(const Tensor& x, Fp8Format f);
// max |x| of each 128x128 block of x [R, C]: f32 [ceil(R/128), ceil(C/128)] on x's device (NaN
// propagated). With quantize_blocks(x, amax, f) below, the blocks of a matrix whose parts live on
// several ranks (--fp8-param-gather: x holds a rank's part, zeros elsewhere) are quantised with the
// whole blocks' scales once the amaxes are reduced (Max) over the ranks.
Tensor block_amax(const Tensor& x);
// The 128x128 blocks of x with the scales of the given block amaxes (block_amax's shape): the
// codes and factors of quantize_blocks(x, f) when amax is x's own.
Fp8Tensor quantize_blocks(const Tensor& x, const Tensor& block_amax, Fp8Format f);
// The transposed operand of a PerTensor or Block128 tensor (codes transposed, factor grid
// transposed): the same values, as dgrad reads the weight. Tile1x128 is refused (its transpose
// is a different quantisation: quantize_tiles(..., true)).
Fp8Tensor fp8_transpose(const Fp8Tensor& t);
// codes * scale_inv in f32 [R, C].
Tensor dequantize(const Fp8Tensor& t);
// C [M, N] (f32 or bf16) = A [M, K] . B [N, K]^T (+ beta C); see above. Any M and K on both
// backends (cuBLASLt's multiples of 16 for K, and for M with block scaling, are met inside the CUDA
// op by zero padding); on CUDA N must be a multiple of 16 (the linears' features: refused there).
void fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& c, float beta = 0.0f);

// ---- Per-tensor scaling state on the device (tensorwise and delayed recipes) ----------------------
// The recipes' amaxes, histories and scales stay where the tensors are: nothing here reads a
// device value on the host, and on the CPU each op computes exactly what the host code did.
enum class Fp8ScaleFrom {
  Amax,    // src holds an amax: scale = fp8_scale_from_amax(src, f, false) (tensorwise)
  Stored,  // src holds a stored scale, 0 meaning "none yet" = 1 (delayed)
};
// max |x| as an f32 [1] tensor on x's device (NaN if x holds one), e.g. to all-reduce (Max).
Tensor amax_tensor(const Tensor& x);
// x [R, C] per tensor with the scale taken on the device from src (f32, one element, x's device):
// the codes and factor of quantize_per_tensor(x, that scale, f). On the CPU a stored scale that is
// negative or not finite is refused as quantize_per_tensor refuses it; a CUDA kernel cannot
// refuse, and quantises with it.
Fp8Tensor quantize_per_tensor(const Tensor& x, const Tensor& src, Fp8ScaleFrom from, Fp8Format f);
// Delayed recipe, history [rows, len] f32 on x's device: history[row, 0] = max(history[row, 0],
// max |x|), a NaN propagating.
void record_amax(const Tensor& x, Tensor& history, int64_t row);
// out [rows] = history[:, 0] (the newest amaxes, to reduce over the ranks).
void history_newest(const Tensor& history, Tensor& out);
// Transformer Engine's delayed-scaling update of every row r of history [rows, len] and scale
// [rows] after the step: history[r, 0] = newest[r]; amax = max(history[r]) (amax_compute_max) or
// history[r, 0]; scale[r] = fp8_max / amax / 2^margin, kept (0 read as 1) when amax is 0 or not
// finite; history[r] rolled by one (torch.roll(h, -1)) and history[r, 0] = 0. fp8_max is
// grad_fp8_max on the rows r % 3 == 2 (the gradients of a linear's x, W, dy sets), else x_w_fp8_max.
struct DelayedScalingUpdate {
  float x_w_fp8_max = 448.0f, grad_fp8_max = 448.0f;
  bool amax_compute_max = false;
  int64_t margin = 0;
};
void delayed_scaling_update(Tensor& history, Tensor& scale, const Tensor& newest, const DelayedScalingUpdate& u);

// The backends, arguments checked (fp8_quant_cuda.cu: the same codes and factors as the CPU).
namespace cpu {
float amax(const Tensor& x);
void quantize_per_tensor(const Tensor& x, float scale, Fp8Tensor& out);
void quantize_tiles(const Tensor& x, bool transpose, Fp8Tensor& out);
void quantize_blocks(const Tensor& x, Fp8Tensor& out);
void block_amax(const Tensor& x, Tensor& out);
void quantize_blocks(const Tensor& x, const Tensor& block_amax, Fp8Tensor& out);
void fp8_transpose(const Fp8Tensor& t, Fp8Tensor& out);
void dequantize(const Fp8Tensor& t, Tensor& out);
void fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& c, float beta);
}  // namespace cpu
namespace cuda {
float amax(const Tensor& x);
void quantize_per_tensor(const Tensor& x, float scale, Fp8Tensor& out);
void quantize_tiles(const Tensor& x, bool transpose, Fp8Tensor& out);
void quantize_blocks(const Tensor& x, Fp8Tensor& out);
void block_amax(const Tensor& x, Tensor& out);
void quantize_blocks(const Tensor& x, const Tensor& block_amax, Fp8Tensor& out);
void fp8_transpose(const Fp8Tensor& t, Fp8Tensor& out);
void dequantize(const Fp8Tensor& t, Tensor& out);
// cuBLASLt FP8 (fp8_gemm_cuda.cpp): per-tensor factors through the A/B scale pointers, 1x128 and
// 128x128 factors through the VEC128_32F / BLK128x128_32F scale modes (Hopper, CUDA 12.9+).
void fp8_gemm(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& c, float beta);
// The device-scale ops above (fp8_quant_cuda.cu); out [1] of amax_tensor zeroed by the caller.
void amax_into(const Tensor& x, Tensor& out);
void quantize_per_tensor(const Tensor& x, const Tensor& src, bool from_amax, Fp8Tensor& out);
void record_amax(const Tensor& x, Tensor& history, int64_t row);
void history_newest(const Tensor& history, Tensor& out);
void delayed_scaling_update(Tensor& history, Tensor& scale, const Tensor& newest, const DelayedScalingUpdate& u);
// A Tile1x128 / Block128 operand's factors in the layout cuBLASLt reads (fp8_gemm_cuda.cpp), on
// the device: packed is zeroed by the caller.
void pack_cublas_factors(const Fp8Tensor& t, Tensor& packed);
}  // namespace cuda

}  // namespace moecore::ops
