// Rotary position embedding (RoPE), rotate-half layout (GPT-NeoX, Megatron's default, HF Llama).
//
// x [B, S, N, D]: batch, sequence, heads, head dim (D even, h = D/2). Token s has position
// p = s + position_offset. For i < h:
//   inv_freq_i = base^(-2i/D),  angle = p * inv_freq_i
//   y[i]     = x[i] cos(angle) - x[i+h] sin(angle)
//   y[i+h]   = x[i+h] cos(angle) + x[i] sin(angle)
// rope_backward applies the transpose rotation (angle -> -angle), which is also the inverse:
//   dx[i] = dy[i] cos + dy[i+h] sin,   dx[i+h] = dy[i+h] cos - dy[i] sin.
// Out may alias in (in place). Dtypes: f32, bf16, f64 (CPU only), in and out the same.
//
// cos/sin come from a [S, h] table computed in double (inv_freq, angle, cos, sin) on both
// backends and rounded to the compute type (fp32, f64 for f64): angles reach 8192 rad and
// more, where an fp32 angle would already be off by ~5e-4 rad. The rotation itself is fp32.
#pragma once

#include <cstdint>

#include "moecore/core/tensor.h"

namespace moecore::ops {

void rope_forward(const Tensor& x, Tensor& y, double base, int64_t position_offset = 0);
void rope_backward(const Tensor& dy, Tensor& dx, double base, int64_t position_offset = 0);

// Backends: arguments already checked; inverse = true rotates by -angle.
namespace cpu {
void rope(const Tensor& in, Tensor& out, double base, int64_t position_offset, bool inverse);
}  // namespace cpu
namespace cuda {
void rope(const Tensor& in, Tensor& out, double base, int64_t position_offset, bool inverse);
}  // namespace cuda

}  // namespace moecore::ops
