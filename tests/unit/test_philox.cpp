#include <gtest/gtest.h>

#include <cmath>

#include "moecore/core/philox.h"
#include "moecore/core/tensor.h"
#include "moecore/ops/random.h"

using namespace moecore;

// Known-answer vectors of Random123 (kat_vectors, philox4x32_10).
TEST(Philox, KnownAnswerVectors) {
  PhiloxWords r = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.w[0], 0x6627e8d5u);
  EXPECT_EQ(r.w[1], 0xe169c58du);
  EXPECT_EQ(r.w[2], 0xbc57ac4cu);
  EXPECT_EQ(r.w[3], 0x9b00dbd8u);
  r = philox4x32_10(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  EXPECT_EQ(r.w[0], 0x408f276du);
  EXPECT_EQ(r.w[1], 0x41c83b0eu);
  EXPECT_EQ(r.w[2], 0xa20bc7c6u);
  EXPECT_EQ(r.w[3], 0x6d5451fdu);
  r = philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.w[0], 0xd16cfe09u);
  EXPECT_EQ(r.w[1], 0x94fdccebu);
  EXPECT_EQ(r.w[2], 0x5001e420u);
  EXPECT_EQ(r.w[3], 0x24126ea1u);
}

TEST(Philox, UniformAndNormalMoments) {
  const int n = 200000;
  double su = 0, su2 = 0, sn = 0, sn2 = 0;
  for (int i = 0; i < n; ++i) {
    const double u = philox_uniform(1, rng_key("moments"), i);
    ASSERT_GT(u, 0.0);
    ASSERT_LT(u, 1.0);
    su += u;
    su2 += u * u;
    const double z = philox_normal(1, rng_key("moments"), i);
    sn += z;
    sn2 += z * z;
  }
  // Standard errors: uniform mean 0.29/sqrt(n) = 6.5e-4, normal mean 2.2e-3, variance 3.2e-3.
  EXPECT_NEAR(su / n, 0.5, 4e-3);
  EXPECT_NEAR(su2 / n - (su / n) * (su / n), 1.0 / 12, 2e-3);
  EXPECT_NEAR(sn / n, 0.0, 1.2e-2);
  EXPECT_NEAR(sn2 / n, 1.0, 1.6e-2);
}

TEST(Philox, SeedKeyAndIndexAllMatter) {
  const uint32_t base = philox_words(1, 2, 3).w[0];
  EXPECT_NE(base, philox_words(2, 2, 3).w[0]);
  EXPECT_NE(base, philox_words(1, 3, 3).w[0]);
  EXPECT_NE(base, philox_words(1, 2, 4).w[0]);
  EXPECT_NE(rng_key("layers.0.attn.qkv.weight"), rng_key("layers.1.attn.qkv.weight"));
  EXPECT_EQ(base, philox_words(1, 2, 3).w[0]) << "not a pure function";
}

TEST(Philox, ShardsDrawTheWholeTensorsValues) {
  // Layout-independent initialisation: rows [4, 10) drawn with the global offset equal the
  // same rows of the whole tensor.
  Tensor whole = Tensor::empty({10, 6}, DType::F32), shard = Tensor::empty({6, 6}, DType::F32);
  ops::fill_normal(whole, 11, rng_key("p"), 0.0, 0.02);
  ops::fill_normal(shard, 11, rng_key("p"), 0.0, 0.02, 4 * 6);
  const std::vector<float> w = whole.to_vector<float>(), s = shard.to_vector<float>();
  for (size_t i = 0; i < s.size(); ++i) ASSERT_EQ(s[i], w[24 + i]) << i;
}

TEST(Philox, FillUniformRangeAndErrors) {
  Tensor t = Tensor::empty({1000}, DType::F64);
  ops::fill_uniform(t, 3, 4, -2.0, 5.0);
  for (double v : t.to_vector<double>()) {
    ASSERT_GE(v, -2.0);
    ASSERT_LT(v, 5.0);
  }
  EXPECT_THROW(ops::fill_uniform(t, 3, 4, 1.0, 0.0), Error);
  EXPECT_THROW(ops::fill_normal(t, 3, 4, 0.0, -1.0), Error);
  Tensor ints = Tensor::empty({4}, DType::I32);
  EXPECT_THROW(ops::fill_normal(ints, 3, 4, 0.0, 1.0), Error);
}
