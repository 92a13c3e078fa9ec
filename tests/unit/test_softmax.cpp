// The commented example of an op test (see tests/support/op_harness.h for the harness).
#include <gtest/gtest.h>

#include <cmath>

#include "moecore/ops/softmax.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

// 1. Values against the formula, computed independently here in double.
TEST(Softmax, ForwardMatchesFormula) {
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    Tensor x = random_tensor({5, 33}, t, Device::cpu(), -10, 10);
    Tensor y = poisoned({5, 33}, t);  // poisoned: every element must be written
    ops::softmax_forward(x, y);
    ASSERT_TRUE(all_written(y));
    const std::vector<double> xv = to_doubles(x);
    std::vector<double> expected(xv.size());
    for (int r = 0; r < 5; ++r) {
      double mx = -INFINITY, sum = 0;
      for (int c = 0; c < 33; ++c) mx = std::max(mx, xv[r * 33 + c]);
      for (int c = 0; c < 33; ++c) sum += std::exp(xv[r * 33 + c] - mx);
      for (int c = 0; c < 33; ++c) expected[r * 33 + c] = std::exp(xv[r * 33 + c] - mx) / sum;
    }
    Tensor ref = Tensor::from_vector(expected, {5, 33});
    EXPECT_TRUE(allclose(y, ref, default_tolerance(t))) << dtype_name(t);
  }
}

// 2. Gradients against finite differences, in f64.
TEST(Softmax, BackwardMatchesFiniteDifferences) {
  Tensor x = random_tensor({4, 9}, DType::F64, Device::cpu(), -3, 3);
  expect_gradients_match(
      {x},
      [](const std::vector<Tensor>& in) {
        Tensor y = Tensor::empty(in[0].shape(), DType::F64);
        ops::softmax_forward(in[0], y);
        return std::vector<Tensor>{y};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        Tensor y = Tensor::empty(in[0].shape(), DType::F64), dx = Tensor::empty(in[0].shape(), DType::F64);
        ops::softmax_forward(in[0], y);
        ops::softmax_backward(y, dout[0], dx);
        return std::vector<Tensor>{dx};
      });
}

// 3. Edge cases and bad arguments.
TEST(Softmax, LargeLogitsDoNotOverflow) {
  Tensor x = Tensor::from_vector<float>({1000.0f, 1000.0f, -1000.0f}, {1, 3});
  Tensor y = Tensor::empty({1, 3}, DType::F32);
  ops::softmax_forward(x, y);
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{0.5f, 0.5f, 0.0f}));
}

TEST(Softmax, RejectsMismatchedArguments) {
  Tensor x = Tensor::zeros({2, 3}, DType::F32), y = Tensor::zeros({3, 2}, DType::F32);
  try {
    ops::softmax_forward(x, y);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "softmax_forward: 'x' has shape (2, 3) but 'y' has shape (3, 2)");
  }
  Tensor yb = Tensor::zeros({2, 3}, DType::BF16);
  EXPECT_THROW(ops::softmax_forward(x, yb), Error);
  Tensor e = Tensor::zeros({2, 0}, DType::F32);
  EXPECT_THROW(ops::softmax_forward(e, e), Error);
}
