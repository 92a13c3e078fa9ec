// AdamW: a two-step sequence written out by hand (double), a reference loop over many steps,
// pure weight decay, and bad configurations / arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "moecore/ops/adamw.h"
#include "moecore/ops/elementwise.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

struct State {
  std::vector<double> p, m, v;
};

// One step of the formula as PyTorch documents it, in double (the test's own reference).
void reference_step(State& s, const std::vector<double>& grad, const ops::AdamWConfig& c, double grad_scale) {
  const double bc1 = 1 - std::pow(c.beta1, c.step), bc2 = 1 - std::pow(c.beta2, c.step);
  for (size_t i = 0; i < s.p.size(); ++i) {
    const double g = grad[i] * grad_scale;
    s.p[i] -= c.lr * c.weight_decay * s.p[i];
    s.m[i] = c.beta1 * s.m[i] + (1 - c.beta1) * g;
    s.v[i] = c.beta2 * s.v[i] + (1 - c.beta2) * g * g;
    s.p[i] -= c.lr * (s.m[i] / bc1) / (std::sqrt(s.v[i] / bc2) + c.eps);
  }
}

Tensor vec(const std::vector<double>& v, DType t) {
  Tensor d = Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
  if (t == DType::F64) return d;
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_vector(f, {static_cast<int64_t>(v.size())});
}

}  // namespace

// Two steps on three parameters, every quantity written out; the first element's value after
// step 1 is also checked against a number worked out on paper.
TEST(AdamW, TwoStepsMatchHandComputedValues) {
  const double lr = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  const double p0[3] = {1.0, -2.0, 0.5}, g1[3] = {0.5, 0.1, -0.3}, g2[3] = {-0.25, 0.2, 0.0};
  const double scale2 = 0.5;  // the second step scales its gradient (loss-scale unscaling)
  double p1[3], m1[3], v1[3], p2[3], m2[3], v2[3];
  for (int i = 0; i < 3; ++i) {
    // step 1: bc1 = 1 - 0.9 = 0.1, bc2 = 1 - 0.999 = 0.001
    m1[i] = 0.1 * g1[i];
    v1[i] = 0.001 * g1[i] * g1[i];
    p1[i] = p0[i] * (1 - lr * wd) - lr * (m1[i] / 0.1) / (std::sqrt(v1[i] / 0.001) + eps);
    // step 2: bc1 = 1 - 0.81 = 0.19, bc2 = 1 - 0.998001 = 0.001999
    const double g = g2[i] * scale2;
    m2[i] = 0.9 * m1[i] + 0.1 * g;
    v2[i] = 0.999 * v1[i] + 0.001 * g * g;
    p2[i] = p1[i] * (1 - lr * wd) - lr * (m2[i] / 0.19) / (std::sqrt(v2[i] / 0.001999) + eps);
  }
  // On paper: m_hat = 0.5, v_hat = 0.25, so p1 = 0.999 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.899000002.
  EXPECT_NEAR(p1[0], 0.899000002, 1e-12);

  Tensor p = vec({p0[0], p0[1], p0[2]}, DType::F64), m = Tensor::zeros({3}, DType::F64),
         v = Tensor::zeros({3}, DType::F64);
  ops::AdamWConfig c{lr, b1, b2, eps, wd, 1};
  ops::adamw_step(p, vec({g1[0], g1[1], g1[2]}, DType::F64), m, v, c);
  const Tolerance tol{1e-15, 1e-12};
  EXPECT_TRUE(allclose(p, vec({p1[0], p1[1], p1[2]}, DType::F64), tol));
  EXPECT_TRUE(allclose(m, vec({m1[0], m1[1], m1[2]}, DType::F64), tol));
  EXPECT_TRUE(allclose(v, vec({v1[0], v1[1], v1[2]}, DType::F64), tol));
  c.step = 2;
  ops::adamw_step(p, vec({g2[0], g2[1], g2[2]}, DType::F64), m, v, c, static_cast<float>(scale2));
  EXPECT_TRUE(allclose(p, vec({p2[0], p2[1], p2[2]}, DType::F64), tol));
  EXPECT_TRUE(allclose(m, vec({m2[0], m2[1], m2[2]}, DType::F64), tol));
  EXPECT_TRUE(allclose(v, vec({v2[0], v2[1], v2[2]}, DType::F64), tol));
}

// Twelve steps with fresh random gradients, against reference_step, in f64 and f32.
TEST(AdamW, ManyStepsMatchReferenceLoop) {
  const int64_t n = 1000;
  for (DType t : {DType::F64, DType::F32}) {
    State s{to_doubles(random_tensor({n}, DType::F64)), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
    Tensor p = vec(s.p, t), m = Tensor::zeros({n}, t), v = Tensor::zeros({n}, t);
    ops::AdamWConfig c{3e-3, 0.9, 0.95, 1e-8, 0.1, 0};
    for (int step = 1; step <= 12; ++step) {
      c.step = step;
      const float scale = step % 3 == 0 ? 0.25f : 1.0f;
      const std::vector<double> g = to_doubles(random_tensor({n}, t, Device::cpu(), -2, 2));  // exact in t
      reference_step(s, g, c, scale);
      ops::adamw_step(p, vec(g, t), m, v, c, scale);
    }
    // f32 rounds each of ~10 operations per step; over 12 steps errors stay ~1e-6 relative.
    const Tolerance tol = t == DType::F64 ? Tolerance{1e-14, 1e-11} : Tolerance{1e-6, 1e-5};
    EXPECT_TRUE(allclose(p, Tensor::from_vector(s.p, {n}), tol)) << dtype_name(t) << " param";
    EXPECT_TRUE(allclose(m, Tensor::from_vector(s.m, {n}), tol)) << dtype_name(t) << " exp_avg";
    EXPECT_TRUE(allclose(v, Tensor::from_vector(s.v, {n}), tol)) << dtype_name(t) << " exp_avg_sq";
  }
}

// With a zero gradient only the decoupled decay acts: p becomes p * (1 - lr * wd) exactly.
TEST(AdamW, WeightDecayAloneShrinksParamsExactly) {
  const int64_t n = 257;
  Tensor p = random_tensor({n}, DType::F64, Device::cpu(), -3, 3);
  const std::vector<double> before = p.to_vector<double>();
  Tensor g = Tensor::zeros({n}, DType::F64), m = Tensor::zeros({n}, DType::F64), v = Tensor::zeros({n}, DType::F64);
  const double lr = 1e-3, wd = 0.1;
  ops::adamw_step(p, g, m, v, {lr, 0.9, 0.999, 1e-8, wd, 5});
  const std::vector<double> after = p.to_vector<double>();
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(after[i], before[i] * (1 - lr * wd)) << "element " << i;
  for (double x : m.to_vector<double>()) ASSERT_EQ(x, 0.0);
  for (double x : v.to_vector<double>()) ASSERT_EQ(x, 0.0);
}

TEST(AdamW, RejectsBadConfigs) {
  Tensor p = Tensor::zeros({4}, DType::F32), g = Tensor::zeros({4}, DType::F32);
  Tensor m = Tensor::zeros({4}, DType::F32), v = Tensor::zeros({4}, DType::F32);
  const ops::AdamWConfig good{1e-3, 0.9, 0.999, 1e-8, 0.1, 1};
  EXPECT_NO_THROW(ops::adamw_step(p, g, m, v, good));
  auto expect_bad = [&](ops::AdamWConfig c, const char* what) {
    EXPECT_THROW(ops::adamw_step(p, g, m, v, c), Error) << what;
  };
  ops::AdamWConfig c = good;
  c.lr = -1e-3;
  try {
    ops::adamw_step(p, g, m, v, c);
    FAIL() << "negative lr accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: lr = -0.001; expected lr >= 0");
  }
  c = good, c.eps = -1e-8, expect_bad(c, "negative eps");
  c = good, c.beta1 = 1.0, expect_bad(c, "beta1 = 1");
  c = good, c.beta1 = -0.1, expect_bad(c, "beta1 < 0");
  c = good, c.beta2 = 1.5, expect_bad(c, "beta2 > 1");
  c = good, c.step = 0, expect_bad(c, "step 0");
  c = good, c.weight_decay = -0.1, expect_bad(c, "negative weight decay");
  c = good, c.lr = std::nan(""), expect_bad(c, "NaN lr");
}

TEST(AdamW, RejectsMismatchedTensors) {
  Tensor p = Tensor::zeros({4}, DType::F32), m = Tensor::zeros({4}, DType::F32), v = Tensor::zeros({4}, DType::F32);
  const ops::AdamWConfig c{1e-3, 0.9, 0.999, 1e-8, 0.1, 1};
  try {
    ops::adamw_step(p, Tensor::zeros({4}, DType::F64), m, v, c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: 'grad' has dtype f64; expected param's dtype f32");
  }
  EXPECT_THROW(ops::adamw_step(p, Tensor::zeros({5}, DType::F32), m, v, c), Error);
  Tensor pb = Tensor::zeros({4}, DType::BF16);
  EXPECT_THROW(ops::adamw_step(pb, Tensor::zeros({4}, DType::BF16), m, v, c), Error);  // bf16 master weights
}

// The precision-aware optimizer: f32 params with bf16 moments are, bit for bit, the f32-moment
// optimizer (held to the double reference above) with the moments rounded to bf16 after every
// step; the update itself uses the unrounded f32 moments of its own step.
TEST(AdamW, Bf16MomentsAreF32MomentsRoundedEachStep) {
  const int64_t n = 1000;
  auto round_trip = [](Tensor& t) {  // f32 -> bf16 -> f32, in place
    Tensor b = Tensor::empty(t.shape(), DType::BF16);
    ops::cast(t, b);
    ops::cast(b, t);
  };
  for (int which = 0; which < 3; ++which) {  // bf16 m only, v only, both
    const bool m16 = which != 1, v16 = which != 0;
    const Tensor p0 = random_tensor({n}, DType::F32);
    Tensor p_ref = p0.clone(), m_ref = Tensor::zeros({n}, DType::F32), v_ref = Tensor::zeros({n}, DType::F32);
    Tensor p = p0.clone();
    Tensor m = Tensor::zeros({n}, m16 ? DType::BF16 : DType::F32), v = Tensor::zeros({n}, v16 ? DType::BF16 : DType::F32);
    ops::AdamWConfig c{3e-3, 0.9, 0.95, 1e-8, 0.1, 0};
    for (int step = 1; step <= 12; ++step) {
      c.step = step;
      const Tensor g = random_tensor({n}, DType::F32, Device::cpu(), -2, 2);
      const float scale = step % 3 == 0 ? 0.25f : 1.0f;
      ops::adamw_step(p_ref, g, m_ref, v_ref, c, scale);
      if (m16) round_trip(m_ref);
      if (v16) round_trip(v_ref);
      ops::adamw_step(p, g, m, v, c, scale);
    }
    EXPECT_EQ(p.to_vector<float>(), p_ref.to_vector<float>()) << "param, case " << which;
    EXPECT_EQ(to_doubles(m), to_doubles(m_ref)) << "exp_avg, case " << which;
    EXPECT_EQ(to_doubles(v), to_doubles(v_ref)) << "exp_avg_sq, case " << which;
    EXPECT_EQ(m.dtype(), m16 ? DType::BF16 : DType::F32);
    EXPECT_EQ(v.dtype(), v16 ? DType::BF16 : DType::F32);
  }
  // bf16 moments need f32 params, and only moments may be bf16.
  Tensor p = Tensor::zeros({4}, DType::F32), g = Tensor::zeros({4}, DType::F32);
  Tensor m = Tensor::zeros({4}, DType::BF16), v = Tensor::zeros({4}, DType::BF16);
  const ops::AdamWConfig c{1e-3, 0.9, 0.999, 1e-8, 0.1, 1};
  EXPECT_NO_THROW(ops::adamw_step(p, g, m, v, c));
  EXPECT_THROW(ops::adamw_step(p, Tensor::zeros({4}, DType::BF16), m, v, c), Error);  // bf16 grad
  Tensor p64 = Tensor::zeros({4}, DType::F64);
  try {
    ops::adamw_step(p64, Tensor::zeros({4}, DType::F64), m, v, c);
    FAIL() << "bf16 moments with f64 params accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: 'exp_avg' has dtype bf16; expected param's dtype f64");
  }
}

// The fused compute-weight write: the bf16 weight is exactly cast(updated param), whatever the
// moments' dtype; other combinations are refused with the argument's name.
TEST(AdamW, ComputeWeightIsTheCastOfTheUpdatedParam) {
  const int64_t n = 777;
  const ops::AdamWConfig c{1e-2, 0.9, 0.95, 1e-8, 0.1, 3};
  for (DType moments : {DType::F32, DType::BF16}) {
    Tensor p = random_tensor({n}, DType::F32), g = random_tensor({n}, DType::F32);
    Tensor m = Tensor::zeros({n}, moments), v = Tensor::zeros({n}, moments);
    Tensor p_ref = p.clone(), m_ref = m.clone(), v_ref = v.clone();
    Tensor w = Tensor::zeros({n}, DType::BF16);
    ops::adamw_step(p, g, m, v, c, 0.5f, &w);
    ops::adamw_step(p_ref, g, m_ref, v_ref, c, 0.5f);
    EXPECT_EQ(p.to_vector<float>(), p_ref.to_vector<float>()) << "the weight output changed the update";
    Tensor cast = Tensor::empty({n}, DType::BF16);
    ops::cast(p, cast);
    EXPECT_EQ(to_doubles(w), to_doubles(cast)) << dtype_name(moments);
  }
  Tensor p = Tensor::zeros({4}, DType::F32), g = p.clone(), m = p.clone(), v = p.clone();
  Tensor w32 = Tensor::zeros({4}, DType::F32);
  try {
    ops::adamw_step(p, g, m, v, c, 1.0f, &w32);
    FAIL() << "an f32 compute weight accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: 'compute_weight' is f32 with param f32; expected bf16 with an f32 param");
  }
  Tensor w_short = Tensor::zeros({3}, DType::BF16);
  EXPECT_THROW(ops::adamw_step(p, g, m, v, c, 1.0f, &w_short), Error);
}
