// The harness must be able to fail: each check is shown catching a deliberately broken op.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>

#include "moecore/ops/elementwise.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {
// Runs f with gtest's failures captured; true when at least one failure mentions `needle`.
template <typename F>
bool fails_mentioning(F&& f, const std::string& needle) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    f();
  }
  for (int i = 0; i < results.size(); ++i)
    if (results.GetTestPartResult(i).failed() &&
        std::string(results.GetTestPartResult(i).message()).find(needle) != std::string::npos)
      return true;
  return false;
}
}  // namespace

TEST(Harness, PoisonCatchesAnUnwrittenElement) {
  Tensor y = poisoned({10}, DType::F32);
  Tensor partial = y.slice(0, 0, 9);
  ops::fill(partial, 1.0);  // the "op" forgets the last element
  EXPECT_FALSE(all_written(y));
  Tensor full = poisoned({10}, DType::BF16);
  ops::fill(full, 1.0);
  EXPECT_TRUE(all_written(full));
  Tensor ints = poisoned({3}, DType::I32);
  EXPECT_FALSE(all_written(ints));
}

TEST(Harness, AllcloseRejectsDifferencesAndNan) {
  Tensor a = Tensor::from_vector<float>({1.0f, 2.0f}, {2});
  EXPECT_TRUE(allclose(a, Tensor::from_vector<float>({1.0f, 2.00001f}, {2}), {1e-5, 1e-5}));
  EXPECT_FALSE(allclose(a, Tensor::from_vector<float>({1.0f, 2.1f}, {2}), {1e-5, 1e-5}));
  EXPECT_FALSE(allclose(a, Tensor::from_vector<float>({1.0f, NAN}, {2}), {1, 1}));
  EXPECT_FALSE(allclose(a, Tensor::from_vector<float>({1.0f}, {1}), {1, 1}));
}

TEST(Harness, DeviceComparisonCatchesAWrongAndAnIncompleteOp) {
  // Both "devices" are the CPU; the op misbehaves on its first run (the device under test).
  Tensor x = random_tensor({64}, DType::F32);
  int calls = 0;
  auto wrong = [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
    ops::silu_forward(in[0], out[0]);
    if (calls++ == 0) ops::axpby(1.01f, out[0], 0.0f, out[0], out[0]);
  };
  EXPECT_TRUE(fails_mentioning(
      [&] {
        expect_devices_match(Device::cpu(), Device::cpu(), {x}, {{{64}, DType::F32}}, wrong,
                             {default_tolerance(DType::F32)});
      },
      "differ beyond"));
  calls = 0;
  auto incomplete = [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
    Tensor part = out[0].slice(0, 0, calls++ == 0 ? 63 : 64);
    Tensor src = in[0].slice(0, 0, part.size(0));
    ops::silu_forward(src, part);
  };
  EXPECT_TRUE(fails_mentioning(
      [&] {
        expect_devices_match(Device::cpu(), Device::cpu(), {x}, {{{64}, DType::F32}}, incomplete,
                             {default_tolerance(DType::F32)});
      },
      "still hold the poison"));
}

TEST(Harness, GradientCheckCatchesAWrongBackward) {
  Tensor x = random_tensor({8}, DType::F64, Device::cpu(), -2, 2);
  auto forward = [](const std::vector<Tensor>& in) {
    Tensor y = Tensor::empty(in[0].shape(), DType::F64);
    ops::silu_forward(in[0], y);
    return std::vector<Tensor>{y};
  };
  auto wrong_backward = [](const std::vector<Tensor>& in, const std::vector<Tensor>& dy) {
    Tensor dx = Tensor::empty(in[0].shape(), DType::F64);
    ops::gelu_backward(in[0], dy[0], dx);  // the gradient of another function
    return std::vector<Tensor>{dx};
  };
  EXPECT_TRUE(fails_mentioning([&] { expect_gradients_match({x}, forward, wrong_backward); }, "finite difference"));
  // and passes the right one
  auto right_backward = [](const std::vector<Tensor>& in, const std::vector<Tensor>& dy) {
    Tensor dx = Tensor::empty(in[0].shape(), DType::F64);
    ops::silu_backward(in[0], dy[0], dx);
    return std::vector<Tensor>{dx};
  };
  EXPECT_FALSE(fails_mentioning([&] { expect_gradients_match({x}, forward, right_backward); }, ""));
}
