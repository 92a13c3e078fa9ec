// Narrow floating-point formats: bf16, fp8 e4m3 (OCP "FN": no infinities) and fp8 e5m2.
//
// The conversions here are the only ones moecore uses, on the CPU and inside CUDA kernels
// (they are MC_HD), so a tensor converted on either device has identical bits. Rules:
//  - float -> narrow rounds to nearest, ties to even.
//  - bf16 keeps infinities; NaN becomes a quiet NaN with the sign kept.
//  - fp8 saturates (the "satfinite" rule used for FP8 training): values, infinities
//    included, beyond the largest finite value become +-max (448 for e4m3, 57344 for
//    e5m2); NaN becomes the format's NaN (0x7F, sign kept).
// The GPU tests hold these against CUDA's own intrinsics (__float2bfloat16_rn,
// __nv_cvt_float_to_fp8 with __NV_SATFINITE).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "moecore/core/host_device.h"

namespace moecore {

MC_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

MC_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- bf16: the top 16 bits of a float --------------------------------------
MC_HD uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; overflow carries into inf correctly
  return static_cast<uint16_t>(u >> 16);
}
MC_HD float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// ---- fp8 -------------------------------------------------------------------
// Generic float -> 1.E.M conversion with round-to-nearest-even and saturation.
// value = sig * 2^(e-23) with sig the 24-bit significand. For a target exponent field te
// (biased), the quantum is 2^(max(te,1) - bias - M); the number of quanta n (rounded) plus
// (max(te,1)-1) << M is the code: a carry out of the mantissa bumps the exponent, and a
// subnormal that rounds up to the smallest normal lands on it, both for free.
template <int kExpBits, int kManBits, int kBias, uint32_t kMaxCode, uint32_t kNanCode>
MC_HD uint8_t float_to_fp8_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint8_t>(sign | kNanCode);
  if (abs >= 0x7f800000u) return static_cast<uint8_t>(sign | kMaxCode);  // inf saturates
  const int exp_field = static_cast<int>(abs >> 23);
  if (exp_field == 0) return static_cast<uint8_t>(sign);  // float subnormals are far below fp8's range
  const uint32_t sig = (abs & 0x7fffffu) | 0x800000u;
  const int te = exp_field - 127 + kBias;
  const int shift = 23 - kManBits + (te < 1 ? 1 - te : 0);
  uint32_t n;
  if (shift >= 26) {
    n = 0;  // below half of the smallest subnormal
  } else {
    const uint32_t q = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    n = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  }
  const int te_eff = te < 1 ? 1 : te;
  const uint64_t code = static_cast<uint64_t>(n) + (static_cast<uint64_t>(te_eff - 1) << kManBits);
  if (code > kMaxCode) return static_cast<uint8_t>(sign | kMaxCode);
  return static_cast<uint8_t>(sign | static_cast<uint32_t>(code));
}

template <int kExpBits, int kManBits, int kBias, bool kHasInf>
MC_HD float fp8_bits_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> kManBits) & ((1u << kExpBits) - 1u);
  const uint32_t m = b & ((1u << kManBits) - 1u);
  const uint32_t all_ones = (1u << kExpBits) - 1u;
  if (kHasInf) {
    if (e == all_ones) return bits_float(sign | (m == 0 ? 0x7f800000u : 0x7fc00000u));
  } else {
    if (e == all_ones && m == ((1u << kManBits) - 1u)) return bits_float(sign | 0x7fc00000u);
  }
  if (e == 0) {
    if (m == 0) return bits_float(sign);
    // subnormal: m * 2^(1 - bias - M); exact in float
    float v = static_cast<float>(m) * bits_float(static_cast<uint32_t>(127 + 1 - kBias - kManBits) << 23);
    return sign ? -v : v;
  }
  return bits_float(sign | ((e - kBias + 127) << 23) | (m << (23 - kManBits)));
}

// e4m3: bias 7, max 448 = code 0x7E; NaN 0x7F.  e5m2: bias 15, max 57344 = code 0x7B; NaN 0x7F.
MC_HD uint8_t float_to_e4m3_bits(float f) { return float_to_fp8_bits<4, 3, 7, 0x7Eu, 0x7Fu>(f); }
MC_HD uint8_t float_to_e5m2_bits(float f) { return float_to_fp8_bits<5, 2, 15, 0x7Bu, 0x7Fu>(f); }
MC_HD float e4m3_bits_to_float(uint8_t b) { return fp8_bits_to_float<4, 3, 7, false>(b); }
MC_HD float e5m2_bits_to_float(uint8_t b) { return fp8_bits_to_float<5, 2, 15, true>(b); }

// Storage types: plain bit containers with explicit conversions, usable in kernels.
struct bf16 {
  uint16_t bits;
  bf16() = default;
  MC_HD explicit bf16(float f) : bits(float_to_bf16_bits(f)) {}
  MC_HD explicit operator float() const { return bf16_bits_to_float(bits); }
  MC_HD static bf16 from_bits(uint16_t b) { bf16 r; r.bits = b; return r; }
};
struct fp8e4m3 {
  uint8_t bits;
  fp8e4m3() = default;
  MC_HD explicit fp8e4m3(float f) : bits(float_to_e4m3_bits(f)) {}
  MC_HD explicit operator float() const { return e4m3_bits_to_float(bits); }
  MC_HD static fp8e4m3 from_bits(uint8_t b) { fp8e4m3 r; r.bits = b; return r; }
};
struct fp8e5m2 {
  uint8_t bits;
  fp8e5m2() = default;
  MC_HD explicit fp8e5m2(float f) : bits(float_to_e5m2_bits(f)) {}
  MC_HD explicit operator float() const { return e5m2_bits_to_float(bits); }
  MC_HD static fp8e5m2 from_bits(uint8_t b) { fp8e5m2 r; r.bits = b; return r; }
};
static_assert(sizeof(bf16) == 2 && sizeof(fp8e4m3) == 1 && sizeof(fp8e5m2) == 1);

// Templated kernels compute in Compute<T> (double for double, float for everything else):
// load<T>() widens a stored element, store<T>() rounds a computed value into storage.
template <typename T> struct ComputeOf { using type = float; };
template <> struct ComputeOf<double> { using type = double; };
template <typename T> using Compute = typename ComputeOf<T>::type;

template <typename T>
MC_HD Compute<T> load(T v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return v;
  } else {
    return static_cast<float>(v);
  }
}

template <typename T, typename C>
MC_HD T store(C v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return static_cast<T>(v);
  } else {
    return T(static_cast<float>(v));
  }
}

}  // namespace moecore
