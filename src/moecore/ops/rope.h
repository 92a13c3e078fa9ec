// Rotary position embedding (RoPE), rotate-half layout (GPT-NeoX, Megatron's default, HF Llama).
//
// x [B, S, N, D]: batch, sequence, heads, head dim (D even, h = D/2). Token s has position
// p = s + position_offset. For i < h:
//   inv_freq_i = base^(-2i/D),  angle = p * inv_freq_i
//   y[i]     = x[i] cos(angle) - x[i+h] sin(angle)
//   y[i+h]   = x[i+h] cos(angle) + x[i] sin(angle)
// rope_backward applies the transpose rotation (angle -> -angle), which is also the inverse
// (with YaRN's cos/sin magnitude below only the transpose):
//   dx[i] = dy[i] cos + dy[i+h] sin,   dx[i+h] = dy[i+h] cos - dy[i] sin.
// Out may alias in (in place). Dtypes: f32, bf16, f64 (CPU only), in and out the same.
//
// cos/sin come from a [S, h] table computed in double (inv_freq, angle, cos, sin) on both
// backends and rounded to the compute type (fp32, f64 for f64): angles reach 8192 rad and
// more, where an fp32 angle would already be off by ~5e-4 rad. The rotation itself is fp32.
//
// YaRN (--rope-type yarn; Megatron's YarnRotaryEmbedding, HF rope_scaling type "yarn"), with
// scaling factor f, original context L, beta_fast / beta_slow and D the rotated dim:
//   corr(r)  = D ln(L / (2 pi r)) / (2 ln base)        (the dim where r rotations fit in L)
//   low      = max(floor(corr(beta_fast)), 0),  high = min(ceil(corr(beta_slow)), D - 1)
//   ramp_i   = clamp((i - low) / (high - low), 0, 1)   (high - low = 0.001 when they are equal)
//   inv_freq_i = (base^(-2i/D) / f) ramp_i + base^(-2i/D) (1 - ramp_i)
// and cos/sin are multiplied by the attention factor yarn_mscale(f, mscale) /
// yarn_mscale(f, mscale_all_dim), yarn_mscale(f, m) = 1 for f <= 1, else 0.1 m ln f + 1.
#pragma once

#include <cmath>
#include <cstdint>

#include "moecore/core/host_device.h"
#include "moecore/core/tensor.h"

namespace moecore::ops {

// YaRN's parameters; factor 0 is plain RoPE.
struct RopeScaling {
  double factor = 0;
  double original_max_position = 4096;
  double beta_fast = 32, beta_slow = 1;
  double mscale = 1, mscale_all_dim = 0;
  bool yarn() const { return factor > 0; }
};

// YaRN's magnitude correction: 1 for factor <= 1, else 0.1 mscale ln(factor) + 1. MLA multiplies
// its softmax scale by yarn_mscale(factor, mscale_all_dim)^2.
double yarn_mscale(double factor, double mscale);

// The frequencies of one call, computed on the host (the ramp bounds, the attention factor) and
// evaluated per pair by both backends in double.
struct RopeFrequencies {
  double base = 10000.0;
  int64_t dim = 0;  // D
  bool yarn = false;
  double factor = 1, low = 0, high = 1, attention = 1;
};
RopeFrequencies rope_frequencies(double base, int64_t dim, const RopeScaling& scaling);

MC_HD double rope_inv_freq(const RopeFrequencies& f, int64_t i) {
  const double extrapolated = pow(f.base, -2.0 * static_cast<double>(i) / static_cast<double>(f.dim));
  if (!f.yarn) return extrapolated;
  double ramp = (static_cast<double>(i) - f.low) / (f.high - f.low);
  ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
  return extrapolated / f.factor * ramp + extrapolated * (1.0 - ramp);
}

void rope_forward(const Tensor& x, Tensor& y, double base, int64_t position_offset = 0);
void rope_backward(const Tensor& dy, Tensor& dx, double base, int64_t position_offset = 0);
// With YaRN scaling (scaling.factor 0: the same as the calls above).
void rope_forward(const Tensor& x, Tensor& y, double base, const RopeScaling& scaling, int64_t position_offset);
void rope_backward(const Tensor& dy, Tensor& dx, double base, const RopeScaling& scaling, int64_t position_offset);

// Backends: arguments already checked; inverse = true rotates by -angle.
namespace cpu {
void rope(const Tensor& in, Tensor& out, const RopeFrequencies& f, int64_t position_offset, bool inverse);
}  // namespace cpu
namespace cuda {
void rope(const Tensor& in, Tensor& out, const RopeFrequencies& f, int64_t position_offset, bool inverse);
}  // namespace cuda

}  // namespace moecore::ops
