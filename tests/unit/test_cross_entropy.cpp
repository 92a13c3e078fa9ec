// Cross-entropy: values against the formula (double, written here), ignored targets, the
// in-place backward, an f64 gradient check, and bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "moecore/ops/cross_entropy.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

// Targets in [0, classes) with every `ignore_every`-th row ignored (-1 or -100, as PyTorch's
// ignore_index).
std::vector<int32_t> make_targets(int64_t rows, int64_t classes, int ignore_every) {
  std::mt19937_64 gen(fresh_seed());
  std::vector<int32_t> t(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    t[r] = (r % ignore_every == 1) ? (r % 2 ? -1 : -100) : static_cast<int32_t>(gen() % classes);
  return t;
}

DType row_dtype(DType t) { return t == DType::F64 ? DType::F64 : DType::F32; }

struct Expected {
  std::vector<double> loss, lse, dlogits;
};

// The formula, in double: lse = log sum exp, loss = lse - x[target],
// dx = dloss * (softmax - onehot); ignored rows: loss 0 and dx 0.
Expected formula(const std::vector<double>& x, const std::vector<int32_t>& tg, const std::vector<double>& dloss,
                 int64_t rows, int64_t classes) {
  Expected e;
  e.loss.resize(rows);
  e.lse.resize(rows);
  e.dlogits.assign(x.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double mx = -INFINITY, sum = 0;
    for (int64_t c = 0; c < classes; ++c) mx = std::max(mx, x[r * classes + c]);
    for (int64_t c = 0; c < classes; ++c) sum += std::exp(x[r * classes + c] - mx);
    e.lse[r] = mx + std::log(sum);
    if (tg[r] < 0) {
      e.loss[r] = 0;
      continue;
    }
    e.loss[r] = e.lse[r] - x[r * classes + tg[r]];
    for (int64_t c = 0; c < classes; ++c)
      e.dlogits[r * classes + c] = dloss[r] * (std::exp(x[r * classes + c] - e.lse[r]) - (c == tg[r] ? 1.0 : 0.0));
  }
  return e;
}

}  // namespace

TEST(CrossEntropy, ForwardMatchesFormula) {
  const int64_t rows = 7, classes = 53;
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    Tensor x = random_tensor({rows, classes}, t, Device::cpu(), -6, 6);
    const std::vector<int32_t> tg = make_targets(rows, classes, 3);
    Tensor targets = Tensor::from_vector(tg, {rows});
    Tensor loss = poisoned({rows}, row_dtype(t)), lse = poisoned({rows}, row_dtype(t));
    ops::cross_entropy_forward(x, targets, loss, lse);
    ASSERT_TRUE(all_written(loss));
    ASSERT_TRUE(all_written(lse));
    const Expected e = formula(to_doubles(x), tg, std::vector<double>(rows, 1.0), rows, classes);
    // bf16 logits are exact inputs; the math is fp32, so f32 tolerances hold for them too.
    const Tolerance tol = t == DType::F64 ? default_tolerance(DType::F64) : default_tolerance(DType::F32);
    EXPECT_TRUE(allclose(loss, Tensor::from_vector(e.loss, {rows}), tol)) << dtype_name(t);
    EXPECT_TRUE(allclose(lse, Tensor::from_vector(e.lse, {rows}), tol)) << dtype_name(t);
    const std::vector<double> lv = to_doubles(loss);
    for (int64_t r = 0; r < rows; ++r)
      if (tg[r] < 0) EXPECT_EQ(lv[r], 0.0) << "ignored row " << r << " has a loss";
  }
}

// Backward against the formula, out of place and in place (dlogits is logits).
TEST(CrossEntropy, BackwardMatchesFormulaInPlaceAndNot) {
  const int64_t rows = 9, classes = 41;
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    Tensor x = random_tensor({rows, classes}, t, Device::cpu(), -4, 4);
    const std::vector<int32_t> tg = make_targets(rows, classes, 4);
    Tensor targets = Tensor::from_vector(tg, {rows});
    Tensor dloss = random_tensor({rows}, row_dtype(t), Device::cpu(), -2, 2);
    Tensor loss = Tensor::empty({rows}, row_dtype(t)), lse = Tensor::empty({rows}, row_dtype(t));
    ops::cross_entropy_forward(x, targets, loss, lse);
    const Expected e = formula(to_doubles(x), tg, to_doubles(dloss), rows, classes);
    Tensor expected = Tensor::from_vector(e.dlogits, {rows, classes});

    Tensor dx = poisoned({rows, classes}, t);
    ops::cross_entropy_backward(x, targets, lse, dloss, dx);
    ASSERT_TRUE(all_written(dx));
    EXPECT_TRUE(allclose(dx, expected, default_tolerance(t))) << dtype_name(t) << " out of place";

    Tensor inplace = x.clone();
    ops::cross_entropy_backward(inplace, targets, lse, dloss, inplace);
    EXPECT_TRUE(allclose(inplace, expected, default_tolerance(t))) << dtype_name(t) << " in place";
    EXPECT_TRUE(allclose(inplace, dx, Tolerance{0, 0})) << dtype_name(t) << " in place differs from out of place";

    const std::vector<double> dv = to_doubles(dx);
    for (int64_t r = 0; r < rows; ++r)
      if (tg[r] < 0)
        for (int64_t c = 0; c < classes; ++c) ASSERT_EQ(dv[r * classes + c], 0.0) << "ignored row " << r;
  }
}

// f64 finite differences for the logits. The targets are an input too (passed as integral
// f64 values because the harness takes f64 inputs) and have no gradient.
TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 5, classes = 11;
  Tensor x = random_tensor({rows, classes}, DType::F64, Device::cpu(), -3, 3);
  const std::vector<int32_t> tg = make_targets(rows, classes, 3);
  Tensor targets_f64 = Tensor::from_vector(std::vector<double>(tg.begin(), tg.end()), {rows});
  auto as_i32 = [](const Tensor& t) {
    const std::vector<double> v = to_doubles(t);
    return Tensor::from_vector(std::vector<int32_t>(v.begin(), v.end()), {t.numel()});
  };
  expect_gradients_match(
      {x, targets_f64},
      [&](const std::vector<Tensor>& in) {
        Tensor loss = Tensor::empty({rows}, DType::F64), lse = Tensor::empty({rows}, DType::F64);
        ops::cross_entropy_forward(in[0], as_i32(in[1]), loss, lse);
        return std::vector<Tensor>{loss};
      },
      [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        Tensor loss = Tensor::empty({rows}, DType::F64), lse = Tensor::empty({rows}, DType::F64);
        Tensor targets = as_i32(in[1]);
        ops::cross_entropy_forward(in[0], targets, loss, lse);
        Tensor dx = Tensor::empty({rows, classes}, DType::F64);
        ops::cross_entropy_backward(in[0], targets, lse, dout[0], dx);
        return std::vector<Tensor>{dx, Tensor()};
      });
}

TEST(CrossEntropy, LargeLogitsDoNotOverflow) {
  Tensor x = Tensor::from_vector<float>({1000.0f, 1000.0f, -1000.0f, -5e4f, 0.0f, 5e4f}, {2, 3});
  Tensor targets = Tensor::from_vector<int32_t>({0, 0}, {2});
  Tensor loss = Tensor::empty({2}, DType::F32), lse = Tensor::empty({2}, DType::F32);
  ops::cross_entropy_forward(x, targets, loss, lse);
  const std::vector<float> l = loss.to_vector<float>();
  EXPECT_NEAR(l[0], std::log(2.0f), 1e-6f);
  EXPECT_EQ(l[1], 1e5f);
}

TEST(CrossEntropy, TargetOutOfRangeNamesRowAndValue) {
  Tensor x = Tensor::zeros({4, 10}, DType::F32);
  Tensor targets = Tensor::from_vector<int32_t>({1, -1, 10, 3}, {4});
  Tensor loss = Tensor::empty({4}, DType::F32), lse = Tensor::empty({4}, DType::F32);
  try {
    ops::cross_entropy_forward(x, targets, loss, lse);
    FAIL() << "target 10 with 10 classes was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "cross_entropy_forward: targets[2] = 10 is out of range for 10 classes (expected 0 <= target < 10, "
                 "or negative to ignore the row)");
  }
  Tensor dloss = Tensor::zeros({4}, DType::F32), dx = Tensor::empty({4, 10}, DType::F32);
  try {
    ops::cross_entropy_backward(x, targets, lse, dloss, dx);
    FAIL() << "backward accepted target 10 with 10 classes";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cross_entropy_backward: targets[2] = 10"), std::string::npos) << e.what();
  }
}

TEST(CrossEntropy, RejectsBadArguments) {
  Tensor x = Tensor::zeros({4, 10}, DType::F32);
  Tensor targets = Tensor::zeros({4}, DType::I32);
  Tensor loss = Tensor::empty({4}, DType::F32), lse = Tensor::empty({4}, DType::F32);
  // targets must be i32
  try {
    ops::cross_entropy_forward(x, Tensor::zeros({4}, DType::F32), loss, lse);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "cross_entropy_forward: argument 'targets' has dtype f32; expected one of i32");
  }
  EXPECT_THROW(ops::cross_entropy_forward(x, Tensor::zeros({5}, DType::I32), loss, lse), Error);  // wrong T
  Tensor loss_bf16 = Tensor::empty({4}, DType::BF16);
  EXPECT_THROW(ops::cross_entropy_forward(x, targets, loss_bf16, lse), Error);  // loss must be f32
  Tensor x64 = Tensor::zeros({4, 10}, DType::F64);
  EXPECT_THROW(ops::cross_entropy_forward(x64, targets, loss, lse), Error);  // f64 logits need f64 loss
  EXPECT_THROW(ops::cross_entropy_forward(Tensor::zeros({40}, DType::F32), targets, loss, lse), Error);  // not 2-D
  Tensor dloss = Tensor::zeros({4}, DType::F32);
  Tensor dx_bf16 = Tensor::empty({4, 10}, DType::BF16);
  EXPECT_THROW(ops::cross_entropy_backward(x, targets, lse, dloss, dx_bf16), Error);  // dtype differs from logits
  // dlogits overlapping logits with a shift cannot be computed in place.
  Tensor big = Tensor::zeros({5, 10}, DType::F32);
  Tensor a = big.slice(0, 0, 4), b = big.slice(0, 1, 5);
  EXPECT_THROW(ops::cross_entropy_backward(a, targets, lse, dloss, b), Error);
}
