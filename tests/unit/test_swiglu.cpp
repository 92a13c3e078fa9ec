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
