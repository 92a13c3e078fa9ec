#include <gtest/gtest.h>

#include <cmath>

#include "moecore/ops/elementwise.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {
// out = f(x) elementwise in double, as the reference.
Tensor map_doubles(const Tensor& x, double (*f)(double)) {
  std::vector<double> v = to_doubles(x);
  for (double& e : v) e = f(e);
  return Tensor::from_vector(v, x.shape());
}
double silu_ref(double x) { return x / (1 + std::exp(-x)); }
double gelu_ref(double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }
double sigmoid_ref(double x) { return 1 / (1 + std::exp(-x)); }

using UnaryOp = void (*)(const Tensor&, Tensor&);
using UnaryGrad = void (*)(const Tensor&, const Tensor&, Tensor&);

void check_activation_gradient(UnaryOp fwd, UnaryGrad bwd) {
  Tensor x = random_tensor({3, 11}, DType::F64, Device::cpu(), -5, 5);
  expect_gradients_match(
      {x},
      [fwd](const std::vector<Tensor>& in) {
        Tensor y = Tensor::empty(in[0].shape(), DType::F64);
        fwd(in[0], y);
        return std::vector<Tensor>{y};
      },
      [bwd](const std::vector<Tensor>& in, const std::vector<Tensor>& dy) {
        Tensor dx = Tensor::empty(in[0].shape(), DType::F64);
        bwd(in[0], dy[0], dx);
        return std::vector<Tensor>{dx};
      });
}
}  // namespace

TEST(Elementwise, ActivationsMatchFormulas) {
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    Tensor x = random_tensor({257}, t, Device::cpu(), -8, 8);
    Tensor y = poisoned({257}, t);
    ops::silu_forward(x, y);
    ASSERT_TRUE(all_written(y));
    EXPECT_TRUE(allclose(y, map_doubles(x, silu_ref), default_tolerance(t))) << "silu " << dtype_name(t);
    ops::gelu_forward(x, y);
    EXPECT_TRUE(allclose(y, map_doubles(x, gelu_ref), default_tolerance(t))) << "gelu " << dtype_name(t);
    ops::sigmoid_forward(x, y);
    EXPECT_TRUE(allclose(y, map_doubles(x, sigmoid_ref), default_tolerance(t))) << "sigmoid " << dtype_name(t);
  }
}

TEST(Elementwise, SiluGradientMatchesFiniteDifferences) { check_activation_gradient(ops::silu_forward, ops::silu_backward); }
TEST(Elementwise, GeluGradientMatchesFiniteDifferences) { check_activation_gradient(ops::gelu_forward, ops::gelu_backward); }
TEST(Elementwise, SigmoidGradientMatchesFiniteDifferences) {
  check_activation_gradient(ops::sigmoid_forward, ops::sigmoid_backward);
}

TEST(Elementwise, BinaryOpsAndTheirGradients) {
  Tensor a = random_tensor({4, 6}, DType::F64), b = random_tensor({4, 6}, DType::F64);
  Tensor out = poisoned({4, 6}, DType::F64);
  ops::axpby(2.0f, a, -0.5f, b, out);
  const std::vector<double> av = to_doubles(a), bv = to_doubles(b), ov = to_doubles(out);
  for (size_t i = 0; i < av.size(); ++i) EXPECT_NEAR(ov[i], 2.0 * av[i] - 0.5 * bv[i], 1e-15);
  // d(a*b)/da = b, d(a*b)/db = a: the mul op's backward is mul itself.
  expect_gradients_match(
      {a, b},
      [](const std::vector<Tensor>& in) {
        Tensor y = Tensor::empty(in[0].shape(), DType::F64);
        ops::mul(in[0], in[1], y);
        return std::vector<Tensor>{y};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& dy) {
        Tensor da = Tensor::empty(in[0].shape(), DType::F64), db = Tensor::empty(in[0].shape(), DType::F64);
        ops::mul(dy[0], in[1], da);
        ops::mul(dy[0], in[0], db);
        return std::vector<Tensor>{da, db};
      });
  ops::add(a, b, a);  // in place
  const std::vector<double> sum = to_doubles(a);
  for (size_t i = 0; i < sum.size(); ++i) EXPECT_DOUBLE_EQ(sum[i], av[i] + bv[i]);
}

TEST(Elementwise, CastRoundsOnceAndKeepsRepresentableValues) {
  Tensor src = Tensor::from_vector<float>({1.0f, 3.14159f, -500.0f, 1e-8f}, {4});
  Tensor b = Tensor::empty({4}, DType::BF16), e4 = Tensor::empty({4}, DType::FP8E4M3);
  ops::cast(src, b);
  ops::cast(src, e4);
  const std::vector<double> bv = to_doubles(b), ev = to_doubles(e4);
  EXPECT_EQ(bv[1], 3.140625);
  EXPECT_EQ(ev[2], -448.0);  // saturated
  EXPECT_EQ(ev[3], 0.0);
  Tensor back = Tensor::empty({4}, DType::F32);
  ops::cast(b, back);  // bf16 values are exact in f32
  EXPECT_EQ(to_doubles(back), bv);
  Tensor f = Tensor::empty({2}, DType::F32);
  ops::fill(f, 0.25);
  EXPECT_EQ(f.to_vector<float>(), (std::vector<float>{0.25f, 0.25f}));
}

// Three bf16 parts add up to the f32 value exactly; two or one leave at most the next part's
// size (2^-16 / 2^-8 relative); each part is the rounding of what the previous ones leave.
TEST(Elementwise, Bf16PartsSumToTheF32Value) {
  const Tensor t = random_tensor({4096}, DType::F32, Device::cpu(), -3, 3);
  const std::vector<double> v = to_doubles(t);
  const std::vector<Tensor> three = ops::bf16_parts(t, 3);
  ASSERT_EQ(three.size(), 3u);
  std::vector<std::vector<double>> p;
  for (const Tensor& x : three) {
    EXPECT_EQ(x.dtype(), DType::BF16);
    p.push_back(to_doubles(x));
  }
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(p[0][i] + p[1][i] + p[2][i], v[i]) << "element " << i;
    EXPECT_LE(std::fabs(v[i] - p[0][i]), std::ldexp(std::fabs(v[i]), -8));
    EXPECT_LE(std::fabs(v[i] - p[0][i] - p[1][i]), std::ldexp(std::fabs(v[i]), -16));
  }
  const std::vector<Tensor> two = ops::bf16_parts(t, 2);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(to_doubles(two[0]), p[0]);
  EXPECT_EQ(to_doubles(two[1]), p[1]);
  EXPECT_THROW(ops::bf16_parts(t, 4), Error);
  EXPECT_THROW(ops::bf16_parts(Tensor::zeros({2}, DType::BF16), 2), Error);
}

TEST(Elementwise, RejectsMismatches) {
  Tensor a = Tensor::zeros({3}, DType::F32), b = Tensor::zeros({3}, DType::BF16), c = Tensor::zeros({4}, DType::F32);
  try {
    ops::add(a, b, a);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "add: dtypes differ (f32, bf16 -> f32); use cast first");
  }
  EXPECT_THROW(ops::mul(a, c, a), Error);
  Tensor i = Tensor::zeros({3}, DType::I32);
  EXPECT_THROW(ops::fill(i, 1.0), Error);
  EXPECT_THROW(ops::cast(a, c), Error);
}
