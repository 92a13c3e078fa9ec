// RMSNorm and LayerNorm: forward against the formulas (double loops here), backward against
// finite differences (f64) for x, weight and bias, f32/bf16 backward against the f64 one,
// gradient accumulation, bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "moecore/ops/norm.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

DType stat_dtype(DType t) { return t == DType::F64 ? DType::F64 : DType::F32; }

// Reference forward in double: y, mean and rstd per row (centered = LayerNorm).
struct NormRef {
  std::vector<double> y, mean, rstd;
};
NormRef norm_reference(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>* b,
                       int64_t rows, int64_t H, double eps, bool centered) {
  NormRef r;
  r.y.resize(x.size());
  for (int64_t i = 0; i < rows; ++i) {
    double mu = 0, var = 0;
    if (centered) {
      for (int64_t h = 0; h < H; ++h) mu += x[i * H + h];
      mu /= H;
    }
    for (int64_t h = 0; h < H; ++h) var += (x[i * H + h] - mu) * (x[i * H + h] - mu);
    const double rs = 1.0 / std::sqrt(var / H + eps);
    for (int64_t h = 0; h < H; ++h)
      r.y[i * H + h] = (x[i * H + h] - mu) * rs * w[h] + (b ? (*b)[h] : 0.0);
    r.mean.push_back(mu);
    r.rstd.push_back(rs);
  }
  return r;
}

Tensor doubles(const std::vector<double>& v, const Shape& s) { return Tensor::from_vector(v, s); }

// Runs the op's backward with zeroed parameter gradients; returns {dx, dweight, dbias}.
std::vector<Tensor> run_backward(bool layer, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy,
                                 double eps) {
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const DType st = stat_dtype(x.dtype());
  Tensor y = Tensor::empty(x.shape(), x.dtype()), mean = Tensor::empty({rows}, st), rstd = Tensor::empty({rows}, st);
  Tensor dx = poisoned(x.shape(), x.dtype());
  Tensor dw = Tensor::zeros({H}, st), db = Tensor::zeros({H}, st);
  if (layer) {
    ops::layernorm_forward(x, w, b, eps, y, mean, rstd);
    ops::layernorm_backward(x, w, mean, rstd, dy, dx, dw, db);
  } else {
    ops::rmsnorm_forward(x, w, eps, y, rstd);
    ops::rmsnorm_backward(x, w, rstd, dy, dx, dw);
  }
  return {dx, dw, layer ? db : Tensor()};
}

}  // namespace

TEST(RMSNorm, ForwardMatchesFormula) {
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    const int64_t rows = 15, H = 37;
    Tensor x = random_tensor({3, 5, H}, t, Device::cpu(), -3, 3), w = random_tensor({H}, t);
    Tensor y = poisoned({3, 5, H}, t), rstd = poisoned({rows}, stat_dtype(t));
    ops::rmsnorm_forward(x, w, 1e-5, y, rstd);
    ASSERT_TRUE(all_written(y));
    ASSERT_TRUE(all_written(rstd));
    const NormRef ref = norm_reference(to_doubles(x), to_doubles(w), nullptr, rows, H, 1e-5, false);
    EXPECT_TRUE(allclose(y, doubles(ref.y, {3, 5, H}), default_tolerance(t))) << dtype_name(t);
    EXPECT_TRUE(allclose(rstd, doubles(ref.rstd, {rows}), default_tolerance(stat_dtype(t)))) << dtype_name(t);
  }
}

TEST(LayerNorm, ForwardMatchesFormula) {
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    const int64_t rows = 15, H = 37;
    // An offset mean makes the centering matter.
    Tensor x = random_tensor({rows, H}, t, Device::cpu(), -1, 4), w = random_tensor({H}, t), b = random_tensor({H}, t);
    Tensor y = poisoned({rows, H}, t), mean = poisoned({rows}, stat_dtype(t)), rstd = poisoned({rows}, stat_dtype(t));
    ops::layernorm_forward(x, w, b, 1e-5, y, mean, rstd);
    ASSERT_TRUE(all_written(y));
    const std::vector<double> bv = to_doubles(b);
    const NormRef ref = norm_reference(to_doubles(x), to_doubles(w), &bv, rows, H, 1e-5, true);
    EXPECT_TRUE(allclose(y, doubles(ref.y, {rows, H}), default_tolerance(t))) << dtype_name(t);
    EXPECT_TRUE(allclose(mean, doubles(ref.mean, {rows}), default_tolerance(stat_dtype(t)))) << dtype_name(t);
    EXPECT_TRUE(allclose(rstd, doubles(ref.rstd, {rows}), default_tolerance(stat_dtype(t)))) << dtype_name(t);
  }
}

TEST(RMSNorm, EpsAndHandComputedRow) {
  // x = (3, 4): mean(x^2) = 12.5; with eps = 3.5, rstd = 1/4 exactly.
  Tensor x = Tensor::from_vector<float>({3.0f, 4.0f}, {1, 2}), w = Tensor::from_vector<float>({1.0f, 2.0f}, {2});
  Tensor y = Tensor::empty({1, 2}, DType::F32), rstd = Tensor::empty({1}, DType::F32);
  ops::rmsnorm_forward(x, w, 3.5, y, rstd);
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{0.75f, 2.0f}));
  EXPECT_EQ(rstd.to_vector<float>(), (std::vector<float>{0.25f}));
}

// f64 finite differences for x, weight (and bias) through y.
TEST(RMSNorm, BackwardMatchesFiniteDifferences) {
  Tensor x = random_tensor({2, 3, 11}, DType::F64, Device::cpu(), -2, 2), w = random_tensor({11}, DType::F64);
  expect_gradients_match(
      {x, w},
      [](const std::vector<Tensor>& in) {
        Tensor y = Tensor::empty(in[0].shape(), DType::F64), rstd = Tensor::empty({6}, DType::F64);
        ops::rmsnorm_forward(in[0], in[1], 1e-3, y, rstd);
        return std::vector<Tensor>{y};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        std::vector<Tensor> g = run_backward(false, in[0], in[1], Tensor(), dout[0], 1e-3);
        return std::vector<Tensor>{g[0], g[1]};
      });
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  Tensor x = random_tensor({6, 11}, DType::F64, Device::cpu(), -2, 3);
  Tensor w = random_tensor({11}, DType::F64), b = random_tensor({11}, DType::F64);
  expect_gradients_match(
      {x, w, b},
      [](const std::vector<Tensor>& in) {
        Tensor y = Tensor::empty(in[0].shape(), DType::F64);
        Tensor mean = Tensor::empty({6}, DType::F64), rstd = Tensor::empty({6}, DType::F64);
        ops::layernorm_forward(in[0], in[1], in[2], 1e-3, y, mean, rstd);
        return std::vector<Tensor>{y};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        return run_backward(true, in[0], in[1], in[2], dout[0], 1e-3);
      });
}

// The f32 and bf16 paths against the f64 path (checked above) on the same rounded inputs.
TEST(Norm, LowPrecisionBackwardMatchesF64) {
  for (bool layer : {false, true}) {
    for (DType t : {DType::F32, DType::BF16}) {
      const int64_t rows = 40, H = 70;
      Tensor x = random_tensor({rows, H}, t, Device::cpu(), -2, 3), w = random_tensor({H}, t);
      Tensor b = random_tensor({H}, t), dy = random_tensor({rows, H}, t);
      auto f64 = [](const Tensor& a) {
        Tensor d = Tensor::from_vector(to_doubles(a), a.shape());
        return d;
      };
      std::vector<Tensor> lo = run_backward(layer, x, w, b, dy, 1e-5);
      std::vector<Tensor> hi = run_backward(layer, f64(x), f64(w), f64(b), f64(dy), 1e-5);
      ASSERT_TRUE(all_written(lo[0]));
      const std::string what = std::string(layer ? "layernorm " : "rmsnorm ") + dtype_name(t);
      EXPECT_TRUE(allclose(lo[0], hi[0], t == DType::F32 ? Tolerance{1e-5, 1e-4} : default_tolerance(t))) << what;
      // Parameter gradients are f32 sums of 40 rows: fp32 rounding only.
      EXPECT_TRUE(allclose(lo[1], hi[1], Tolerance{1e-4, 1e-5})) << what;
      if (layer) EXPECT_TRUE(allclose(lo[2], hi[2], Tolerance{1e-4, 1e-5})) << what;
    }
  }
}

TEST(Norm, BackwardAccumulatesParameterGradients) {
  for (DType t : {DType::F32, DType::F64}) {
    const int64_t rows = 9, H = 13;
    const DType st = stat_dtype(t);
    Tensor x = random_tensor({rows, H}, t), w = random_tensor({H}, t), b = random_tensor({H}, t);
    Tensor dy = random_tensor({rows, H}, t);
    Tensor y = Tensor::empty({rows, H}, t), dx = Tensor::empty({rows, H}, t);
    Tensor mean = Tensor::empty({rows}, st), rstd = Tensor::empty({rows}, st);
    ops::layernorm_forward(x, w, b, 1e-5, y, mean, rstd);
    Tensor dw = Tensor::zeros({H}, st), db = Tensor::zeros({H}, st);
    ops::layernorm_backward(x, w, mean, rstd, dy, dx, dw, db);
    const std::vector<double> dw1 = to_doubles(dw), db1 = to_doubles(db);
    ops::layernorm_backward(x, w, mean, rstd, dy, dx, dw, db);
    const std::vector<double> dw2 = to_doubles(dw), db2 = to_doubles(db);
    // RMSNorm on top of a nonzero start: start + g.
    Tensor start = random_tensor({H}, st), dwr = start.clone(), dwr_once = Tensor::zeros({H}, st);
    ops::rmsnorm_forward(x, w, 1e-5, y, rstd);
    ops::rmsnorm_backward(x, w, rstd, dy, dx, dwr_once);
    ops::rmsnorm_backward(x, w, rstd, dy, dx, dwr);
    const std::vector<double> s = to_doubles(start), once = to_doubles(dwr_once), acc = to_doubles(dwr);
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_NE(dw1[h], 0.0);
      // x + x is exact in binary floating point: twice means bit-for-bit double.
      EXPECT_EQ(dw2[h], 2 * dw1[h]) << dtype_name(t) << " h=" << h;
      EXPECT_EQ(db2[h], 2 * db1[h]) << dtype_name(t) << " h=" << h;
      EXPECT_NEAR(acc[h], s[h] + once[h], 1e-6) << dtype_name(t) << " h=" << h;
    }
  }
}

TEST(Norm, AcceptsOneDimensionalInputAndLeadingShapeStats) {
  Tensor x = random_tensor({16}, DType::F32), w = random_tensor({16}, DType::F32);
  Tensor y = poisoned({16}, DType::F32), rstd = poisoned({1}, DType::F32);
  ops::rmsnorm_forward(x, w, 1e-6, y, rstd);
  EXPECT_TRUE(all_written(y));
  Tensor x3 = random_tensor({2, 3, 8}, DType::F32), w8 = random_tensor({8}, DType::F32);
  Tensor y3 = poisoned({2, 3, 8}, DType::F32), r23 = poisoned({2, 3}, DType::F32);
  ops::rmsnorm_forward(x3, w8, 1e-6, y3, r23);
  EXPECT_TRUE(all_written(r23));
}

TEST(Norm, RejectsBadArguments) {
  const int64_t rows = 4, H = 8;
  Tensor x = Tensor::zeros({rows, H}, DType::F32), w = Tensor::zeros({H}, DType::F32);
  Tensor y = Tensor::zeros({rows, H}, DType::F32), rstd = Tensor::zeros({rows}, DType::F32);
  try {
    Tensor w_bad = Tensor::zeros({H + 1}, DType::F32);
    ops::rmsnorm_forward(x, w_bad, 1e-5, y, rstd);
    FAIL() << "a weight of the wrong length was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rmsnorm_forward: argument 'weight' has shape (9); expected (8)");
  }
  try {
    Tensor rstd_bf16 = Tensor::zeros({rows}, DType::BF16);
    ops::rmsnorm_forward(x, w, 1e-5, y, rstd_bf16);
    FAIL() << "a bf16 rstd was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rmsnorm_forward: argument 'rstd' has dtype bf16; expected f32");
  }
  Tensor w64 = Tensor::zeros({H}, DType::F64);
  EXPECT_THROW(ops::rmsnorm_forward(x, w64, 1e-5, y, rstd), Error);                         // weight dtype
  EXPECT_THROW(ops::rmsnorm_forward(x, w, -1.0, y, rstd), Error);                           // eps < 0
  Tensor rstd_short = Tensor::zeros({rows - 1}, DType::F32);
  EXPECT_THROW(ops::rmsnorm_forward(x, w, 1e-5, y, rstd_short), Error);                     // rstd length
  Tensor y_t = Tensor::zeros({H, rows}, DType::F32);
  EXPECT_THROW(ops::rmsnorm_forward(x, w, 1e-5, y_t, rstd), Error);                         // y shape
  Tensor xi = Tensor::zeros({rows, H}, DType::I32);
  EXPECT_THROW(ops::rmsnorm_forward(xi, w, 1e-5, y, rstd), Error);                          // integer x
  Tensor e = Tensor::zeros({rows, 0}, DType::F32), w0 = Tensor::zeros({0}, DType::F32);
  EXPECT_THROW(ops::rmsnorm_forward(e, w0, 1e-5, e, rstd), Error);                          // H = 0
  Tensor xt = Tensor::zeros({H, rows}, DType::F32).transpose(0, 1);
  EXPECT_THROW(ops::rmsnorm_forward(xt, w, 1e-5, y, rstd), Error);                          // not contiguous

  Tensor dy = Tensor::zeros({rows, H}, DType::F32), dx = Tensor::zeros({rows, H}, DType::F32);
  Tensor dw_bf16 = Tensor::zeros({H}, DType::BF16), dw = Tensor::zeros({H}, DType::F32);
  EXPECT_THROW(ops::rmsnorm_backward(x, w, rstd, dy, dx, dw_bf16), Error);                  // dweight dtype
  Tensor dy_bad = Tensor::zeros({rows, H + 1}, DType::F32);
  EXPECT_THROW(ops::rmsnorm_backward(x, w, rstd, dy_bad, dx, dw), Error);                   // dy shape

  Tensor b = Tensor::zeros({H}, DType::F32), mean = Tensor::zeros({rows}, DType::F32);
  Tensor b_bad = Tensor::zeros({H}, DType::BF16);
  EXPECT_THROW(ops::layernorm_forward(x, w, b_bad, 1e-5, y, mean, rstd), Error);            // bias dtype
  Tensor mean_bad = Tensor::zeros({rows, 2}, DType::F32);
  EXPECT_THROW(ops::layernorm_forward(x, w, b, 1e-5, y, mean_bad, rstd), Error);            // mean shape
  Tensor db_bad = Tensor::zeros({H - 1}, DType::F32);
  EXPECT_THROW(ops::layernorm_backward(x, w, mean, rstd, dy, dx, dw, db_bad), Error);       // dbias shape
  Tensor x64 = Tensor::zeros({rows, H}, DType::F64), r32 = Tensor::zeros({rows}, DType::F32);
  Tensor w64b = Tensor::zeros({H}, DType::F64), y64 = Tensor::zeros({rows, H}, DType::F64);
  EXPECT_THROW(ops::rmsnorm_forward(x64, w64b, 1e-5, y64, r32), Error);                     // f64 needs f64 stats
}
