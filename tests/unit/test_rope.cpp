// RoPE (rotate-half): forward against the formula (double loops here), backward against
// finite differences (f64), in place, backward(forward(x)) == x, position offsets, bad arguments;
// YaRN: its frequencies for DeepSeek-V3, the forward against the formula, finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "moecore/ops/rope.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

// y for x [B, S, N, D], positions s + offset, written from the formula in the header.
std::vector<double> rope_reference(const std::vector<double>& x, const Shape& shape, double base, int64_t offset) {
  const int64_t B = shape[0], S = shape[1], N = shape[2], D = shape[3], h = D / 2;
  std::vector<double> y(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t o = ((b * S + s) * N + n) * D;
        for (int64_t i = 0; i < h; ++i) {
          const double theta = static_cast<double>(s + offset) * std::pow(base, -2.0 * i / D);
          y[o + i] = x[o + i] * std::cos(theta) - x[o + i + h] * std::sin(theta);
          y[o + i + h] = x[o + i + h] * std::cos(theta) + x[o + i] * std::sin(theta);
        }
      }
  return y;
}

}  // namespace

TEST(Rope, ForwardMatchesFormula) {
  const Shape shape{2, 7, 3, 16};
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    for (int64_t offset : {0, 5, 8000}) {
      Tensor x = random_tensor(shape, t), y = poisoned(shape, t);
      ops::rope_forward(x, y, 10000.0, offset);
      ASSERT_TRUE(all_written(y));
      Tensor ref = Tensor::from_vector(rope_reference(to_doubles(x), shape, 10000.0, offset), shape);
      EXPECT_TRUE(allclose(y, ref, default_tolerance(t))) << dtype_name(t) << " offset " << offset;
    }
  }
}

TEST(Rope, HandComputedSinglePair) {
  // D = 2: one pair, inv_freq = 1, so position p rotates by p radians. At position 0 it is
  // the identity. The base does not matter for i = 0.
  Tensor x = Tensor::from_vector<double>({1.0, 2.0, 1.0, 2.0}, {1, 2, 1, 2});
  Tensor y = Tensor::empty({1, 2, 1, 2}, DType::F64);
  ops::rope_forward(x, y, 500.0, 0);
  const std::vector<double> v = y.to_vector<double>();
  EXPECT_EQ(v[0], 1.0);
  EXPECT_EQ(v[1], 2.0);
  EXPECT_NEAR(v[2], std::cos(1.0) - 2 * std::sin(1.0), 1e-15);
  EXPECT_NEAR(v[3], 2 * std::cos(1.0) + std::sin(1.0), 1e-15);
}

TEST(Rope, BackwardMatchesFiniteDifferences) {
  for (int64_t offset : {0, 1000}) {
    Tensor x = random_tensor({2, 3, 2, 8}, DType::F64);
    expect_gradients_match(
        {x},
        [offset](const std::vector<Tensor>& in) {
          Tensor y = Tensor::empty(in[0].shape(), DType::F64);
          ops::rope_forward(in[0], y, 10000.0, offset);
          return std::vector<Tensor>{y};
        },
        [offset](const std::vector<Tensor>&, const std::vector<Tensor>& dout) {
          Tensor dx = poisoned(dout[0].shape(), DType::F64);
          ops::rope_backward(dout[0], dx, 10000.0, offset);
          return std::vector<Tensor>{dx};
        });
  }
}

TEST(Rope, InPlaceEqualsOutOfPlace) {
  for (DType t : {DType::F32, DType::BF16, DType::F64}) {
    const Shape shape{2, 5, 4, 32};
    Tensor x = random_tensor(shape, t), y = Tensor::empty(shape, t);
    ops::rope_forward(x, y, 10000.0, 3);
    Tensor z = x.clone();
    ops::rope_forward(z, z, 10000.0, 3);
    EXPECT_TRUE(allclose(z, y, {0.0, 0.0})) << dtype_name(t);
    Tensor dx = Tensor::empty(shape, t);
    ops::rope_backward(x, dx, 10000.0, 3);
    Tensor w = x.clone();
    ops::rope_backward(w, w, 10000.0, 3);
    EXPECT_TRUE(allclose(w, dx, {0.0, 0.0})) << dtype_name(t);
  }
}

// The rotation is orthogonal: its transpose undoes it.
TEST(Rope, BackwardOfForwardIsIdentity) {
  for (DType t : {DType::F64, DType::F32}) {
    const Shape shape{3, 9, 2, 64};
    Tensor x = random_tensor(shape, t), y = Tensor::empty(shape, t), back = poisoned(shape, t);
    ops::rope_forward(x, y, 500000.0, 4000);
    ops::rope_backward(y, back, 500000.0, 4000);
    // f32: two rotations in fp32, each a few roundings of |x| <= 1.
    EXPECT_TRUE(allclose(back, x, t == DType::F64 ? Tolerance{1e-14, 0} : Tolerance{1e-6, 1e-6})) << dtype_name(t);
    EXPECT_FALSE(allclose(y, x, default_tolerance(t))) << "the rotation did nothing";
  }
}

// Token s with offset k is the token s + k of a longer sequence starting at 0.
TEST(Rope, PositionOffsetShiftsPositions) {
  const int64_t B = 2, S = 12, N = 3, D = 16, k = 5;
  Tensor x = random_tensor({B, S, N, D}, DType::F64), y = Tensor::empty({B, S, N, D}, DType::F64);
  ops::rope_forward(x, y, 10000.0, 0);
  Tensor tail = x.slice(1, k, S).contiguous(), y_tail = Tensor::empty({B, S - k, N, D}, DType::F64);
  ops::rope_forward(tail, y_tail, 10000.0, k);
  EXPECT_TRUE(allclose(y_tail, y.slice(1, k, S).contiguous(), {1e-15, 0}));
}

TEST(Rope, RejectsBadArguments) {
  Tensor x = Tensor::zeros({2, 3, 4, 8}, DType::F32), y = Tensor::zeros({2, 3, 4, 8}, DType::F32);
  try {
    Tensor odd = Tensor::zeros({2, 3, 4, 7}, DType::F32);
    ops::rope_forward(odd, odd, 10000.0);
    FAIL() << "an odd head dim was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rope_forward: head dim D = 7 of 'x' must be even and positive");
  }
  try {
    Tensor x3 = Tensor::zeros({6, 4, 8}, DType::F32);
    ops::rope_backward(x3, x3, 10000.0);
    FAIL() << "a 3-d tensor was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rope_backward: 'dy' must be [B, S, N, D] (4 dimensions), got shape (6, 4, 8)");
  }
  Tensor y_bf16 = Tensor::zeros({2, 3, 4, 8}, DType::BF16);
  EXPECT_THROW(ops::rope_forward(x, y_bf16, 10000.0), Error);  // dtype mismatch
  Tensor y_shape = Tensor::zeros({2, 3, 8, 4}, DType::F32);
  EXPECT_THROW(ops::rope_forward(x, y_shape, 10000.0), Error);  // shape mismatch
  EXPECT_THROW(ops::rope_forward(x, y, 0.0), Error);           // base
  EXPECT_THROW(ops::rope_forward(x, y, -10.0), Error);
  EXPECT_THROW(ops::rope_forward(x, y, 10000.0, -1), Error);   // negative offset
  Tensor xi = Tensor::zeros({2, 3, 4, 8}, DType::I32);
  EXPECT_THROW(ops::rope_forward(xi, xi, 10000.0), Error);     // integer dtype
  Tensor xt = Tensor::zeros({2, 3, 8, 4}, DType::F32).transpose(2, 3);
  EXPECT_THROW(ops::rope_forward(xt, y, 10000.0), Error);      // not contiguous
}

// ---- YaRN (--rope-type yarn) ----

namespace {

// YaRN as HF transformers' _compute_yarn_parameters / Megatron's YarnRotaryEmbedding define it,
// written out here independently: frequencies 1 / base^(2i/D), the correction range, the linear
// ramp, the blend and the cos/sin magnitude.
std::vector<double> yarn_reference(const std::vector<double>& x, const Shape& shape, double base, int64_t offset,
                                   const ops::RopeScaling& s) {
  const int64_t B = shape[0], S = shape[1], N = shape[2], D = shape[3], h = D / 2;
  auto corr = [&](double rot) { return D * std::log(s.original_max_position / (rot * 2 * M_PI)) / (2 * std::log(base)); };
  double low = std::max(std::floor(corr(s.beta_fast)), 0.0), high = std::min(std::ceil(corr(s.beta_slow)), D - 1.0);
  if (low == high) high += 0.001;
  auto m = [&](double mscale) { return s.factor <= 1 ? 1.0 : 0.1 * mscale * std::log(s.factor) + 1.0; };
  const double attention = m(s.mscale) / m(s.mscale_all_dim);
  std::vector<double> y(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < S; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t o = ((b * S + t) * N + n) * D;
        for (int64_t i = 0; i < h; ++i) {
          const double pos_freq = std::pow(base, 2.0 * i / D);
          const double extrapolation = 1.0 / pos_freq, interpolation = 1.0 / (s.factor * pos_freq);
          const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
          const double extrapolation_factor = 1.0 - ramp;
          const double inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
          const double theta = static_cast<double>(t + offset) * inv_freq;
          const double c = std::cos(theta) * attention, sn = std::sin(theta) * attention;
          y[o + i] = x[o + i] * c - x[o + i + h] * sn;
          y[o + i + h] = x[o + i + h] * c + x[o + i] * sn;
        }
      }
  return y;
}

ops::RopeScaling deepseek_v3_yarn() {  // DeepSeek-V3's rope_scaling
  ops::RopeScaling s;
  s.factor = 40;
  s.original_max_position = 4096;
  s.beta_fast = 32;
  s.beta_slow = 1;
  s.mscale = 1;
  s.mscale_all_dim = 1;
  return s;
}

}  // namespace

// DeepSeek-V3's numbers (64 RoPE channels, base 10000, original context 4096, betas 32 / 1):
// corr(32) = 64 ln(4096 / 64 pi) / (2 ln 10000) = 10.47 -> 10, corr(1) = 22.5 -> 23; mscale 1 / 1
// cancels in the cos/sin; with --mscale-all-dim 0 the factor is 0.1 ln 40 + 1.
TEST(Rope, YarnFrequenciesOfDeepSeekV3) {
  ops::RopeScaling s = deepseek_v3_yarn();
  ops::RopeFrequencies f = ops::rope_frequencies(10000.0, 64, s);
  EXPECT_TRUE(f.yarn);
  EXPECT_EQ(f.low, 10.0);
  EXPECT_EQ(f.high, 23.0);
  EXPECT_EQ(f.attention, 1.0);
  EXPECT_DOUBLE_EQ(ops::rope_inv_freq(f, 0), 1.0);                            // extrapolated
  EXPECT_DOUBLE_EQ(ops::rope_inv_freq(f, 31), std::pow(10000.0, -62.0 / 64) / 40);  // interpolated
  s.mscale_all_dim = 0;
  EXPECT_DOUBLE_EQ(ops::rope_frequencies(10000.0, 64, s).attention, 0.1 * std::log(40.0) + 1);
  EXPECT_DOUBLE_EQ(ops::yarn_mscale(40, 1), 0.1 * std::log(40.0) + 1);
  EXPECT_EQ(ops::yarn_mscale(1, 1), 1.0);
  EXPECT_FALSE(ops::rope_frequencies(10000.0, 64, ops::RopeScaling{}).yarn);
}

TEST(Rope, YarnForwardMatchesFormula) {
  const Shape shape{2, 9, 3, 64};
  ops::RopeScaling s = deepseek_v3_yarn();
  s.mscale = 0.9;  // a cos/sin magnitude != 1
  s.original_max_position = 64;
  for (DType t : {DType::F32, DType::F64, DType::BF16})
    for (int64_t offset : {0, 3000}) {
      Tensor x = random_tensor(shape, t), y = poisoned(shape, t);
      ops::rope_forward(x, y, 10000.0, s, offset);
      ASSERT_TRUE(all_written(y));
      Tensor ref = Tensor::from_vector(yarn_reference(to_doubles(x), shape, 10000.0, offset, s), shape);
      EXPECT_TRUE(allclose(y, ref, default_tolerance(t))) << dtype_name(t) << " offset " << offset;
      Tensor plain = Tensor::empty(shape, t);
      ops::rope_forward(x, plain, 10000.0, offset);
      if (offset > 0) EXPECT_FALSE(allclose(y, plain, default_tolerance(t))) << "YaRN changed nothing";
    }
}

TEST(Rope, YarnBackwardMatchesFiniteDifferences) {
  ops::RopeScaling s = deepseek_v3_yarn();
  s.mscale = 0.7;
  s.original_max_position = 32;
  for (int64_t offset : {0, 100}) {
    Tensor x = random_tensor({2, 3, 2, 16}, DType::F64);
    expect_gradients_match(
        {x},
        [&](const std::vector<Tensor>& in) {
          Tensor y = Tensor::empty(in[0].shape(), DType::F64);
          ops::rope_forward(in[0], y, 10000.0, s, offset);
          return std::vector<Tensor>{y};
        },
        [&](const std::vector<Tensor>&, const std::vector<Tensor>& dout) {
          Tensor dx = poisoned(dout[0].shape(), DType::F64);
          ops::rope_backward(dout[0], dx, 10000.0, s, offset);
          return std::vector<Tensor>{dx};
        });
  }
}
