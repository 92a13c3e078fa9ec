// dtype conversions on the CPU: hand-picked cases (ties, subnormals, saturation, NaN),
// every fp8 code round-trips, and, where the CUDA toolkit is present, agreement with its
// host-side reference conversions over millions of floats (the GPU tier checks all 2^32
// patterns against the hardware intrinsics).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "moecore/core/dtype.h"
#include "moecore/core/error.h"
#include "moecore/core/philox.h"

#if MOECORE_WITH_CUDA
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif

using namespace moecore;

namespace {
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

TEST(Dtype, SizesNamesAndParsing) {
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::FP8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::BF16);
  EXPECT_EQ(parse_dtype("e5m2"), DType::FP8E5M2);
  EXPECT_STREQ(dtype_name(parse_dtype("fp32")), "f32");
  try {
    parse_dtype("float16x");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown dtype 'float16x'"), std::string::npos);
  }
}

TEST(Dtype, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x3F808000)), 0x3F80);  // tie, even stays
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x3F818000)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x3F808001)), 0x3F81);  // just above the tie
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(from_bits(0x7F7FFFFF)), 0x7F80);  // max float rounds to inf
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7F80);
  const uint16_t nan = float_to_bf16_bits(from_bits(0xFF800001));  // signalling NaN, tiny payload
  EXPECT_EQ(nan & 0x8000, 0x8000);
  EXPECT_GT(nan & 0x7FFF, 0x7F80) << "NaN must stay NaN";
  EXPECT_EQ(bf16_bits_to_float(0x4049), 3.140625f);
}

TEST(Dtype, E4m3CasesSaturationAndSubnormals) {
  EXPECT_EQ(float_to_e4m3_bits(1.0f), 0x38);
  EXPECT_EQ(float_to_e4m3_bits(448.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(464.0f), 0x7E);  // tie between 448 and (NaN-coded) 480: saturates
  EXPECT_EQ(float_to_e4m3_bits(1e6f), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(float_to_e4m3_bits(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
  EXPECT_EQ(float_to_e4m3_bits(std::ldexp(1.0f, -9)), 0x01);     // smallest subnormal
  EXPECT_EQ(float_to_e4m3_bits(std::ldexp(1.0f, -10)), 0x00);    // half of it: tie to even (0)
  EXPECT_EQ(float_to_e4m3_bits(std::ldexp(1.5f, -10)), 0x01);    // above the tie
  EXPECT_EQ(float_to_e4m3_bits(std::ldexp(3.0f, -10)), 0x02);    // 1.5 subnormal steps: tie to even 2
  EXPECT_EQ(float_to_e4m3_bits(std::ldexp(0.96875f, -6)), 0x08);  // rounds up into the smallest normal
  EXPECT_EQ(float_to_e4m3_bits(1.0625f), 0x38);                   // 1 + 1/16: tie, even mantissa 0
  EXPECT_EQ(float_to_e4m3_bits(1.1875f), 0x3A);                   // 1 + 3/16: tie, rounds to mantissa 2
  EXPECT_EQ(e4m3_bits_to_float(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(0x7F)));
  EXPECT_EQ(e4m3_bits_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(Dtype, E5m2CasesSaturationAndInfinities) {
  EXPECT_EQ(float_to_e5m2_bits(1.0f), 0x3C);
  EXPECT_EQ(float_to_e5m2_bits(57344.0f), 0x7B);
  EXPECT_EQ(float_to_e5m2_bits(1e9f), 0x7B);
  EXPECT_EQ(float_to_e5m2_bits(std::numeric_limits<float>::infinity()), 0x7B);  // satfinite
  EXPECT_EQ(float_to_e5m2_bits(std::ldexp(1.0f, -16)), 0x01);
  EXPECT_EQ(e5m2_bits_to_float(0x7C), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(e5m2_bits_to_float(0x7F)));
}

TEST(Dtype, EveryFiniteFp8CodeRoundTripsAndDecodesMonotonically) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float a = e4m3_bits_to_float(code);
    if (!std::isnan(a)) {
      EXPECT_EQ(float_to_e4m3_bits(a), (a == 0 && (c & 0x80)) ? 0x80 : code) << "e4m3 code " << c;
    }
    const float b = e5m2_bits_to_float(code);
    if (std::isfinite(b)) EXPECT_EQ(float_to_e5m2_bits(b), code) << "e5m2 code " << c;
  }
  for (int c = 1; c < 0x7F; ++c) EXPECT_LT(e4m3_bits_to_float(c - 1), e4m3_bits_to_float(c)) << c;
  for (int c = 1; c < 0x7C; ++c) EXPECT_LT(e5m2_bits_to_float(c - 1), e5m2_bits_to_float(c)) << c;
}

#if MOECORE_WITH_CUDA
// The CUDA headers' host code paths implement the same conversions in software; hold ours to
// them over structured and random bit patterns.
TEST(Dtype, MatchesCudaHeadersHostConversions) {
  int64_t checked = 0;
  auto check = [&](uint32_t bits) {
    const float f = from_bits(bits);
    const __nv_bfloat16 ref_bf = __float2bfloat16_rn(f);
    uint16_t rb;
    std::memcpy(&rb, &ref_bf, 2);
    if (!std::isnan(f)) ASSERT_EQ(float_to_bf16_bits(f), rb) << std::hex << "bf16 bits 0x" << bits;
    const uint8_t r4 = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
    const uint8_t r5 = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E5M2);
    if (!std::isnan(f)) {
      ASSERT_EQ(float_to_e4m3_bits(f), r4) << std::hex << "e4m3 bits 0x" << bits;
      ASSERT_EQ(float_to_e5m2_bits(f), r5) << std::hex << "e5m2 bits 0x" << bits;
    }
    ++checked;
  };
  // Every float with exponent field in fp8's range and the top 12 mantissa bits (ties and
  // near-ties included through the low bits), then random patterns.
  for (uint32_t e = 100; e <= 150; ++e)
    for (uint32_t m = 0; m < (1u << 12); ++m)
      for (uint32_t low : {0u, 1u, 0x7FFu, 0x400u})
        for (uint32_t s : {0u, 0x80000000u}) check(s | (e << 23) | (m << 11) | low);
  for (uint64_t i = 0; i < 2000000; ++i) check(philox_words(3, 4, i).w[0]);
  EXPECT_GT(checked, 2000000);
}
#endif
