// Philox4x32-10 counter-based random numbers (Salmon et al., SC'11), identical on CPU and GPU.
//
// A number is a pure function of (seed, stream key, index): no state, no sequence. moecore
// draws element i of a parameter from counter = (i, hash(parameter name)), key = seed, so
// every TP/EP/PP/DP layout that holds element i draws the same value for it
// (layout-independent initialisation), and a kernel may compute any element in any order.
//
// Each (seed, key, index) yields four 32-bit words. uniform() uses word 0; normal() uses
// words 0 and 1 through Box-Muller in double precision. Words and uniforms are bit-identical
// across devices; normals can differ in the last bit where the device's log/cos round
// differently from the host's (the GPU test bounds this by one float ulp).
#pragma once

#include <cstdint>
#include <string_view>

#include "moecore/core/host_device.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace moecore {

struct PhiloxWords {
  uint32_t w[4];
};

MC_HD uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

MC_HD PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(kM0, c0, &hi0);
    const uint32_t lo1 = mulhilo32(kM1, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

// The four words for (seed, stream key, index).
MC_HD PhiloxWords philox_words(uint64_t seed, uint64_t stream_key, uint64_t index) {
  return philox4x32_10(static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                       static_cast<uint32_t>(stream_key), static_cast<uint32_t>(stream_key >> 32),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Uniform in (0, 1): the top 24 bits of word 0, centred in their interval (exact in float).
MC_HD float philox_uniform(uint64_t seed, uint64_t stream_key, uint64_t index) {
  const uint32_t w = philox_words(seed, stream_key, index).w[0];
  return (static_cast<float>(w >> 8) + 0.5f) * (1.0f / 16777216.0f);
}

// Standard normal (Box-Muller, cosine branch) in double precision.
MC_HD double philox_normal(uint64_t seed, uint64_t stream_key, uint64_t index) {
  const PhiloxWords r = philox_words(seed, stream_key, index);
  const double u1 = (static_cast<double>(r.w[0]) + 0.5) * (1.0 / 4294967296.0);
  const double u2 = (static_cast<double>(r.w[1]) + 0.5) * (1.0 / 4294967296.0);
  constexpr double kTwoPi = 6.283185307179586476925286766559;
#if defined(__CUDA_ARCH__)
  return sqrt(-2.0 * log(u1)) * cos(kTwoPi * u2);
#else
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
#endif
}

// lo + (hi - lo) * u without fused multiply-add, so CPU and GPU round identically (nvcc would
// otherwise contract it into an FMA; baseline x86-64 code has none).
MC_HD float uniform_between(float lo, float hi, float u) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(lo, __fmul_rn(__fsub_rn(hi, lo), u));
#else
  return lo + (hi - lo) * u;
#endif
}

// mean + std * z, likewise without FMA.
MC_HD double normal_scaled(double mean, double std, double z) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(mean, __dmul_rn(std, z));
#else
  return mean + std * z;
#endif
}

// Stream key of a name (64-bit FNV-1a): the parameter name keys its initialisation.
constexpr uint64_t rng_key(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace moecore
