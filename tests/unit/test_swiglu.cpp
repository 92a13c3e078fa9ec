#include <gtest/gtest.h>

#include <cmath>

#include "moecore/ops/swiglu.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

TEST(Swiglu, ForwardMatchesFormula) {
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    Tensor x = random_tensor({3, 2, 10}, t, Device::cpu(), -4, 4);  // F = 5
    Tensor y = poisoned({3, 2, 5}, t);
    ops::swiglu_forward(x, y);
    ASSERT_TRUE(all_written(y));
    const std::vector<double> xv = to_doubles(x);
    std::vector<double> expected(30);
    for (int r = 0; r < 6; ++r)
      for (int i = 0; i < 5; ++i) {
        const double g = xv[r * 10 + i], u = xv[r * 10 + 5 + i];
        expected[r * 5 + i] = g / (1 + std::exp(-g)) * u;
      }
    EXPECT_TRUE(allclose(y, Tensor::from_vector(expected, {3, 2, 5}), default_tolerance(t))) << dtype_name(t);
  }
}

TEST(Swiglu, BackwardMatchesFiniteDifferences) {
  Tensor x = random_tensor({4, 12}, DType::F64, Device::cpu(), -3, 3);
  expect_gradients_match(
      {x},
      [](const std::vector<Tensor>& in) {
        Tensor y = Tensor::empty({4, 6}, DType::F64);
        ops::swiglu_forward(in[0], y);
        return std::vector<Tensor>{y};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& dy) {
        Tensor dx = Tensor::empty({4, 12}, DType::F64);
        ops::swiglu_backward(in[0], dy[0], dx);
        return std::vector<Tensor>{dx};
      });
}

TEST(Swiglu, RejectsBadShapes) {
  Tensor x = Tensor::zeros({2, 7}, DType::F32), y = Tensor::zeros({2, 3}, DType::F32);
  try {
    ops::swiglu_forward(x, y);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "swiglu_forward: x Tensor(f32, cpu, (2, 7)) needs an even last dimension [gate | up]");
  }
  Tensor x8 = Tensor::zeros({2, 8}, DType::F32), y3 = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_THROW(ops::swiglu_forward(x8, y3), Error);
}

TEST(Swiglu, WeightedForwardScalesEachRow) {
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    SCOPED_TRACE(dtype_name(t));
    const DType wt = t == DType::F64 ? DType::F64 : DType::F32;
    Tensor x = random_tensor({6, 10}, t, Device::cpu(), -4, 4);  // F = 5
    Tensor w = random_tensor({6, 1}, wt, Device::cpu(), 0, 1);
    Tensor y = poisoned({6, 5}, t);
    ops::weighted_swiglu_forward(x, w, y);
    ASSERT_TRUE(all_written(y));
    const std::vector<double> xv = to_doubles(x), wv = to_doubles(w);
    std::vector<double> expected(30);
    for (int r = 0; r < 6; ++r)
      for (int i = 0; i < 5; ++i) {
        const double g = xv[r * 10 + i], u = xv[r * 10 + 5 + i];
        expected[r * 5 + i] = g / (1 + std::exp(-g)) * u * wv[r];
      }
    EXPECT_TRUE(allclose(y, Tensor::from_vector(expected, {6, 5}), default_tolerance(t)));
  }
}

// Both inputs, x and the row weights, against finite differences.
TEST(Swiglu, WeightedBackwardMatchesFiniteDifferences) {
  Tensor x = random_tensor({5, 12}, DType::F64, Device::cpu(), -3, 3);
  Tensor w = random_tensor({5, 1}, DType::F64, Device::cpu(), -1, 1);
  expect_gradients_match(
      {x, w},
      [](const std::vector<Tensor>& in) {
        Tensor y = Tensor::empty({5, 6}, DType::F64);
        ops::weighted_swiglu_forward(in[0], in[1], y);
        return std::vector<Tensor>{y};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& dy) {
        Tensor dx = poisoned({5, 12}, DType::F64), dw = poisoned({5, 1}, DType::F64);
        ops::weighted_swiglu_backward(in[0], in[1], dy[0], dx, dw);
        EXPECT_TRUE(all_written(dx));
        EXPECT_TRUE(all_written(dw));
        return std::vector<Tensor>{dx, dw};
      });
}

// Weight 1 everywhere is the unweighted op, bit for bit (the same arithmetic times 1).
TEST(Swiglu, UnitWeightsEqualTheUnweightedOp) {
  Tensor x = random_tensor({7, 16}, DType::BF16, Device::cpu(), -4, 4);
  Tensor ones = Tensor::from_vector(std::vector<float>(7, 1.0f), {7});
  Tensor y = Tensor::empty({7, 8}, DType::BF16), yw = Tensor::empty({7, 8}, DType::BF16);
  ops::swiglu_forward(x, y);
  ops::weighted_swiglu_forward(x, ones, yw);
  EXPECT_EQ(to_doubles(y), to_doubles(yw));
  Tensor dy = random_tensor({7, 8}, DType::BF16);
  Tensor dx = Tensor::empty({7, 16}, DType::BF16), dxw = Tensor::empty({7, 16}, DType::BF16);
  Tensor dw = Tensor::empty({7}, DType::F32);
  ops::swiglu_backward(x, dy, dx);
  ops::weighted_swiglu_backward(x, ones, dy, dxw, dw);
  EXPECT_EQ(to_doubles(dx), to_doubles(dxw));
  // dw[r] = sum_i dy[r, i] * swiglu(x)[r, i], from the unrounded activation (fp32 sums of bf16
  // inputs: a relative 1e-5 leaves room for the order of the sum only).
  const std::vector<double> xv = to_doubles(x), dyv = to_doubles(dy), dwv = to_doubles(dw);
  for (int r = 0; r < 7; ++r) {
    double want = 0;
    for (int i = 0; i < 8; ++i) {
      const double g = xv[r * 16 + i], u = xv[r * 16 + 8 + i];
      want += g / (1 + std::exp(-g)) * u * dyv[r * 8 + i];
    }
    EXPECT_NEAR(dwv[r], want, 1e-5 * (1 + std::fabs(want))) << "row " << r;
  }
}

TEST(Swiglu, WeightedRejectsBadWeights) {
  Tensor x = Tensor::zeros({4, 8}, DType::BF16), y = Tensor::zeros({4, 4}, DType::BF16);
  try {
    ops::weighted_swiglu_forward(x, Tensor::zeros({4}, DType::BF16), y);
    FAIL() << "bf16 weights accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "weighted_swiglu_forward: 'w' is bf16 but must be f32 for bf16 x");
  }
  try {
    ops::weighted_swiglu_forward(x, Tensor::zeros({3}, DType::F32), y);
    FAIL() << "3 weights for 4 rows accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "weighted_swiglu_forward: 'w' Tensor(f32, cpu, (3)) must be [4] or [4, 1] (one weight per row of x "
                 "Tensor(bf16, cpu, (4, 8)))");
  }
  Tensor dx = Tensor::zeros({4, 8}, DType::BF16), dy = Tensor::zeros({4, 4}, DType::BF16);
  Tensor dw_short = Tensor::zeros({2}, DType::F32);
  EXPECT_THROW(ops::weighted_swiglu_backward(x, Tensor::zeros({4}, DType::F32), dy, dx, dw_short), Error);
  Tensor no_dw;
  try {
    ops::weighted_swiglu_backward(x, Tensor::zeros({4}, DType::F32), dy, dx, no_dw);
    FAIL() << "an undefined dw accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "weighted_swiglu_backward: 'dw' is undefined (it receives the weights' gradient)");
  }
}

// F = 0: every row's weight gradient is an empty sum.
TEST(Swiglu, WeightedEmptyRowsGiveZeroWeightGradient) {
  Tensor x = Tensor::zeros({3, 0}, DType::F32), dy = Tensor::zeros({3, 0}, DType::F32);
  Tensor dx = Tensor::zeros({3, 0}, DType::F32), w = Tensor::from_vector(std::vector<float>{1, 2, 3}, {3, 1});
  Tensor dw = poisoned({3, 1}, DType::F32);
  ops::weighted_swiglu_backward(x, w, dy, dx, dw);
  EXPECT_EQ(dw.to_vector<float>(), (std::vector<float>{0, 0, 0}));
}
