// An fp32 master weight kept as two 16-bit halves (the default with --bf16, off with
// --no-store-param-remainders; TransformerEngine's FusedAdam stores its masters the same way):
// `high`, the bf16 compute weight the forward reads, and `remainder`, an int16 holding the low 16
// bits. The two are the fp32 value bit for bit, so AdamW keeps full fp32 masters while the model
// holds 2 bytes per parameter fewer than separate fp32 masters and bf16 weights (and the optimizer
// moves 2 bytes fewer per parameter).
//   split: u = the bits of x; high = u >> 16, plus one when bit 15 of u is set (the bf16 nearest
//          to x, a tie rounding away from zero where a cast rounds it to even: 1 value in 65536);
//          remainder = the low 16 bits read as int16 (negative exactly when high was rounded up).
//   join:  high's bits, minus one when remainder < 0, shifted up, OR the remainder's 16 bits.
// A NaN splits as a cast rounds it (quiet, the upper payload bits kept) with remainder 0 (the
// low payload bits are dropped): the plus-one of a NaN whose high bits are all ones would
// otherwise wrap around to a zero.
#pragma once

#include <cstdint>

#include "moecore/core/float_formats.h"
#include "moecore/core/host_device.h"
#include "moecore/core/tensor.h"

namespace moecore::ops {

MC_HD void split_master_value(float x, uint16_t& high, int16_t& remainder) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN
    high = static_cast<uint16_t>((u >> 16) | 0x0040u);
    remainder = 0;
    return;
  }
  high = static_cast<uint16_t>((u >> 16) + ((u >> 15) & 1u));
  remainder = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));
}

MC_HD float join_master_value(uint16_t high, int16_t remainder) {
  const uint32_t h = static_cast<uint32_t>(high) - (remainder < 0 ? 1u : 0u);
  return bits_float(((h & 0xffffu) << 16) | static_cast<uint16_t>(remainder));
}

// master: f32; high: bf16; remainder: i16; one shape, contiguous, one device.
void split_master(const Tensor& master, Tensor& high, Tensor& remainder);
void join_master(const Tensor& high, const Tensor& remainder, Tensor& master);

namespace cpu {
void split_master(const Tensor& master, Tensor& high, Tensor& remainder);
void join_master(const Tensor& high, const Tensor& remainder, Tensor& master);
}  // namespace cpu
namespace cuda {
void split_master(const Tensor& master, Tensor& high, Tensor& remainder);
void join_master(const Tensor& high, const Tensor& remainder, Tensor& master);
}  // namespace cuda

}  // namespace moecore::ops
