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

// The one-pass op equals the two ops on the CPU, out of place and in place, and its errors name
// it (not the op it runs inside).
TEST(CrossEntropy, ForwardBackwardEqualsTheTwoOps) {
  const int64_t rows = 9, classes = 40;
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    const Tensor x = random_tensor({rows, classes}, t, Device::cpu(), -4, 4);
    const Tensor targets = Tensor::from_vector(make_targets(rows, classes, 4), {rows});
    const Tensor dloss = random_tensor({rows}, row_dtype(t), Device::cpu(), -2, 2);
    Tensor loss = Tensor::empty({rows}, row_dtype(t)), lse = Tensor::empty({rows}, row_dtype(t));
    Tensor dx = Tensor::empty({rows, classes}, t);
    ops::cross_entropy_forward(x, targets, loss, lse);
    ops::cross_entropy_backward(x, targets, lse, dloss, dx);
    Tensor loss1 = poisoned({rows}, row_dtype(t)), lse1 = poisoned({rows}, row_dtype(t));
    Tensor dx1 = poisoned({rows, classes}, t);
    ops::cross_entropy_forward_backward(x, targets, dloss, loss1, lse1, dx1);
    EXPECT_EQ(to_doubles(loss1), to_doubles(loss)) << dtype_name(t);
    EXPECT_EQ(to_doubles(lse1), to_doubles(lse)) << dtype_name(t);
    EXPECT_EQ(to_doubles(dx1), to_doubles(dx)) << dtype_name(t);
    Tensor inplace = x.clone();
    ops::cross_entropy_forward_backward(inplace, targets, dloss, loss1, lse1, inplace);
    EXPECT_EQ(to_doubles(loss1), to_doubles(loss)) << dtype_name(t) << " in place";
    EXPECT_EQ(to_doubles(inplace), to_doubles(dx)) << dtype_name(t) << " in place";
  }
  Tensor x = Tensor::zeros({4, 10}, DType::F32);
  const Tensor bad = Tensor::from_vector<int32_t>({1, -1, 10, 3}, {4});
  Tensor loss = Tensor::empty({4}, DType::F32), lse = Tensor::empty({4}, DType::F32);
  const Tensor dloss = Tensor::zeros({4}, DType::F32);
  try {
    ops::cross_entropy_forward_backward(x, bad, dloss, loss, lse, x);
    FAIL() << "target 10 with 10 classes was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "cross_entropy_forward_backward: targets[2] = 10 is out of range for 10 classes (expected 0 <= "
                 "target < 10, or negative to ignore the row)");
  }
  EXPECT_EQ(to_doubles(x), std::vector<double>(40, 0.0)) << "the refused call wrote its gradient";
  Tensor small = Tensor::empty({3}, DType::F32);
  try {
    ops::cross_entropy_forward_backward(x, Tensor::from_vector<int32_t>({1, 2, 3, 4}, {4}), dloss, small, lse, x);
    FAIL() << "a loss of 3 rows for 4 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cross_entropy_forward_backward"), std::string::npos) << e.what();
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

// ---- vocabulary-parallel parts ---------------------------------------------------------

namespace {

// A [n] tensor of `dtype` (f32 or f64) holding v.
Tensor stat_tensor(const std::vector<double>& v, DType dtype) {
  const int64_t n = static_cast<int64_t>(v.size());
  if (dtype == DType::F64) return Tensor::from_vector(v, {n});
  return Tensor::from_vector(std::vector<float>(v.begin(), v.end()), {n});
}

struct PartsResult {
  Tensor loss, lse;
  std::vector<Tensor> dlogits;  // one per part
};

// The recipe of cross_entropy.h with the communication done here on the host: each part's
// forward, the all-gather of lse_part into [P, T], the sum of target_logit, the combine, the
// loss, and each part's backward with the combined lse (in place when asked).
PartsResult run_parts(const Tensor& x, const Tensor& targets, const Tensor& dloss, const std::vector<int64_t>& bounds,
                      bool in_place) {
  const int64_t rows = x.size(0), total = x.size(1), num_parts = static_cast<int64_t>(bounds.size()) - 1;
  const DType rt = row_dtype(x.dtype());
  Tensor parts = Tensor::empty({num_parts, rows}, rt);
  std::vector<double> target_sum(static_cast<size_t>(rows), 0.0);
  std::vector<Tensor> xs;
  for (int64_t p = 0; p < num_parts; ++p) {
    xs.push_back(x.slice(1, bounds[p], bounds[p + 1]).contiguous());
    Tensor lse_part = poisoned({rows}, rt), target_logit = poisoned({rows}, rt);
    ops::cross_entropy_part_forward(xs.back(), targets, bounds[p], total, lse_part, target_logit);
    EXPECT_TRUE(all_written(lse_part));
    EXPECT_TRUE(all_written(target_logit));
    parts.slice(0, p, p + 1).copy_from(lse_part.view({1, rows}));
    const std::vector<double> tl = to_doubles(target_logit);
    for (int64_t r = 0; r < rows; ++r) target_sum[r] += tl[r];
  }
  PartsResult res;
  res.lse = poisoned({rows}, rt);
  ops::logsumexp_combine(parts, res.lse);
  res.loss = poisoned({rows}, rt);
  ops::cross_entropy_combined_loss(res.lse, stat_tensor(target_sum, rt), targets, res.loss);
  for (int64_t p = 0; p < num_parts; ++p) {
    Tensor dx = in_place ? xs[p].clone() : poisoned(xs[p].shape(), x.dtype());
    ops::cross_entropy_backward(in_place ? dx : xs[p], targets, res.lse, dloss, dx, bounds[p], total);
    res.dlogits.push_back(dx);
  }
  return res;
}

// Targets over all classes, with both ends and the part boundaries present, and ignored rows.
std::vector<int32_t> targets_over(int64_t rows, int64_t classes, const std::vector<int64_t>& bounds) {
  std::vector<int32_t> tg = make_targets(rows, classes, 4);  // rows 1, 5, 9, ... ignored
  std::vector<int32_t> wanted{0, static_cast<int32_t>(classes - 1)};
  for (int64_t b : bounds)
    if (b > 0 && b < classes) {
      wanted.push_back(static_cast<int32_t>(b - 1));
      wanted.push_back(static_cast<int32_t>(b));
    }
  size_t k = 0;
  for (int64_t r = 0; r < rows && k < wanted.size(); ++r)
    if (tg[r] >= 0) tg[r] = wanted[k++];
  return tg;
}

}  // namespace

// A 37-class vocabulary split into 2 or 3 uneven parts: the recipe gives the whole-vocabulary
// loss and lse, and each part's gradient is the matching columns of the whole gradient.
TEST(CrossEntropy, VocabPartsCombineToTheWholeVocabulary) {
  const int64_t rows = 16, classes = 37;
  for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{0, 20, 37}, std::vector<int64_t>{0, 5, 19, 37}}) {
    for (DType t : {DType::F32, DType::F64, DType::BF16}) {
      Tensor x = random_tensor({rows, classes}, t, Device::cpu(), -6, 6);
      const std::vector<int32_t> tg = targets_over(rows, classes, bounds);
      Tensor targets = Tensor::from_vector(tg, {rows});
      Tensor dloss = random_tensor({rows}, row_dtype(t), Device::cpu(), -2, 2);
      Tensor loss = Tensor::empty({rows}, row_dtype(t)), lse = Tensor::empty({rows}, row_dtype(t));
      ops::cross_entropy_forward(x, targets, loss, lse);
      Tensor dx = Tensor::empty({rows, classes}, t);
      ops::cross_entropy_backward(x, targets, lse, dloss, dx);

      // Also against the formula written in this file, in double.
      const Expected e = formula(to_doubles(x), tg, to_doubles(dloss), rows, classes);
      // loss = lse - target_logit loses the whole op's cancellation-free form: ~1e-7 * |lse|
      // absolute in fp32 (|lse| < 10 here).
      const Tolerance row_tol = t == DType::F64 ? default_tolerance(DType::F64) : Tolerance{1e-5, 1e-5};
      for (bool in_place : {false, true}) {
        const PartsResult r = run_parts(x, targets, dloss, bounds, in_place);
        const std::string what = std::string(dtype_name(t)) + (in_place ? " in place" : "") + " with " +
                                 std::to_string(bounds.size() - 1) + " parts";
        EXPECT_TRUE(allclose(r.loss, loss, row_tol)) << what;
        EXPECT_TRUE(allclose(r.lse, lse, row_tol)) << what;
        EXPECT_TRUE(allclose(r.loss, Tensor::from_vector(e.loss, {rows}), row_tol)) << what;
        const std::vector<double> lv = to_doubles(r.loss);
        for (int64_t i = 0; i < rows; ++i)
          if (tg[i] < 0) EXPECT_EQ(lv[i], 0.0) << what << ": ignored row " << i << " has a loss";
        for (size_t p = 0; p + 1 < bounds.size(); ++p) {
          const int64_t a = bounds[p], b = bounds[p + 1];
          ASSERT_TRUE(all_written(r.dlogits[p])) << what;
          Tensor ref = Tensor::from_vector(e.dlogits, {rows, classes}).slice(1, a, b).contiguous();
          EXPECT_TRUE(allclose(r.dlogits[p], ref, default_tolerance(t))) << what << " part " << p;
          EXPECT_TRUE(allclose(r.dlogits[p], dx.slice(1, a, b).contiguous(), default_tolerance(t)))
              << what << " part " << p;
          const std::vector<double> dv = to_doubles(r.dlogits[p]);
          for (int64_t i = 0; i < rows; ++i)
            if (tg[i] < 0)
              for (int64_t c = 0; c < b - a; ++c) ASSERT_EQ(dv[i * (b - a) + c], 0.0) << what << " ignored row " << i;
        }
      }
    }
  }
}

// The default arguments (vocab_start = 0, vocab_total = -1) and an explicit whole vocabulary
// agree bit for bit; part_forward over the whole vocabulary gives the forward's lse.
TEST(CrossEntropy, WholeVocabularyAsOnePart) {
  const int64_t rows = 6, classes = 29;
  Tensor x = random_tensor({rows, classes}, DType::F32, Device::cpu(), -5, 5);
  Tensor targets = Tensor::from_vector(make_targets(rows, classes, 3), {rows});
  Tensor dloss = random_tensor({rows}, DType::F32);
  Tensor loss = Tensor::empty({rows}, DType::F32), lse = Tensor::empty({rows}, DType::F32);
  ops::cross_entropy_forward(x, targets, loss, lse);
  Tensor d1 = Tensor::empty({rows, classes}, DType::F32), d2 = Tensor::empty({rows, classes}, DType::F32);
  ops::cross_entropy_backward(x, targets, lse, dloss, d1);
  ops::cross_entropy_backward(x, targets, lse, dloss, d2, 0, classes);
  EXPECT_TRUE(allclose(d1, d2, Tolerance{0, 0}));
  Tensor lse_part = poisoned({rows}, DType::F32), tl = poisoned({rows}, DType::F32);
  ops::cross_entropy_part_forward(x, targets, 0, classes, lse_part, tl);
  EXPECT_TRUE(allclose(lse_part, lse, Tolerance{0, 0}));
}

TEST(CrossEntropy, LogsumexpCombineMatchesFormula) {
  const int64_t num_parts = 3, rows = 8;
  for (DType t : {DType::F32, DType::F64}) {
    Tensor parts = random_tensor({num_parts, rows}, t, Device::cpu(), -50, 50);
    Tensor lse = poisoned({rows}, t);
    ops::logsumexp_combine(parts, lse);
    const std::vector<double> pv = to_doubles(parts);
    std::vector<double> expected(rows);
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t p = 0; p < num_parts; ++p) s += std::exp(pv[p * rows + r] - 50.0);  // |parts| < 50: no overflow
      expected[r] = 50.0 + std::log(s);
    }
    EXPECT_TRUE(allclose(lse, Tensor::from_vector(expected, {rows}), default_tolerance(t))) << dtype_name(t);
  }
  // Large values, an empty part (-inf) and all-empty rows.
  const float inf = INFINITY;
  Tensor parts = Tensor::from_vector<float>({1000.0f, -inf, -inf, 1000.0f, 5.0f, -inf}, {2, 3});
  Tensor lse = Tensor::empty({3}, DType::F32);
  ops::logsumexp_combine(parts, lse);
  const std::vector<float> l = lse.to_vector<float>();
  EXPECT_NEAR(l[0], 1000.0f + std::log(2.0f), 1e-4f);
  EXPECT_EQ(l[1], 5.0f);
  EXPECT_EQ(l[2], -inf);
  // A NaN part makes its row NaN wherever it sits, beside finite, empty or infinite parts.
  const float nan = std::nanf("");
  Tensor with_nan = Tensor::from_vector<float>({nan, -inf, inf, nan, 3.0f, nan, nan, nan, 1.0f}, {3, 3});
  ops::logsumexp_combine(with_nan, lse);
  for (float v : lse.to_vector<float>()) EXPECT_TRUE(std::isnan(v)) << v;
}

// f64 finite differences of the recipe's loss as a function of one part's logits, the other
// parts fixed; the gradient is that part's backward with the combined lse.
TEST(CrossEntropy, VocabPartBackwardMatchesFiniteDifferences) {
  const int64_t rows = 6, classes = 15;
  const std::vector<int64_t> bounds{0, 4, 11, 15};
  Tensor x = random_tensor({rows, classes}, DType::F64, Device::cpu(), -3, 3);
  const Tensor targets = Tensor::from_vector(targets_over(rows, classes, bounds), {rows});
  for (size_t q = 0; q + 1 < bounds.size(); ++q) {
    const int64_t a = bounds[q], b = bounds[q + 1];
    // The full logits with part q replaced by `part`.
    auto with_part = [&](const Tensor& part) {
      Tensor full = x.clone();
      full.slice(1, a, b).copy_from(part);
      return full;
    };
    expect_gradients_match(
        {x.slice(1, a, b).contiguous()},
        [&](const std::vector<Tensor>& in) {
          const PartsResult r = run_parts(with_part(in[0]), targets, Tensor::zeros({rows}, DType::F64), bounds, false);
          return std::vector<Tensor>{r.loss};
        },
        [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
          const PartsResult r = run_parts(with_part(in[0]), targets, dout[0], bounds, false);
          return std::vector<Tensor>{r.dlogits[q]};
        });
  }
}

TEST(CrossEntropy, VocabPartErrors) {
  Tensor x = Tensor::zeros({4, 10}, DType::F32);  // classes [20, 30) of 37
  Tensor lse_part = Tensor::empty({4}, DType::F32), tl = Tensor::empty({4}, DType::F32);
  // Targets of other parts are fine.
  ops::cross_entropy_part_forward(x, Tensor::from_vector<int32_t>({0, -1, 36, 25}, {4}), 20, 37, lse_part, tl);
  EXPECT_EQ(tl.to_vector<float>(), (std::vector<float>{0, 0, 0, 0}));
  Tensor targets = Tensor::from_vector<int32_t>({1, -1, 37, 3}, {4});
  try {
    ops::cross_entropy_part_forward(x, targets, 20, 37, lse_part, tl);
    FAIL() << "target 37 with 37 classes was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "cross_entropy_part_forward: targets[2] = 37 is out of range for 37 classes (expected 0 <= target < "
                 "37, or negative to ignore the row)");
  }
  Tensor dloss = Tensor::zeros({4}, DType::F32), dx = Tensor::empty({4, 10}, DType::F32);
  try {
    ops::cross_entropy_backward(x, targets, lse_part, dloss, dx, 20, 37);
    FAIL() << "backward accepted target 37 with 37 classes";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cross_entropy_backward: targets[2] = 37 is out of range for 37 classes"),
              std::string::npos)
        << e.what();
  }
  Tensor good = Tensor::from_vector<int32_t>({1, -1, 36, 3}, {4});
  try {
    ops::cross_entropy_part_forward(x, good, 30, 37, lse_part, tl);
    FAIL() << "part [30, 40) of 37 classes was accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "cross_entropy_part_forward: the part [30, 40) of 10 classes does not fit in a vocabulary of 37 "
                 "classes (expected 0 <= vocab_start and vocab_start + V <= vocab_total)");
  }
  EXPECT_THROW(ops::cross_entropy_part_forward(x, good, -1, 37, lse_part, tl), Error);
  EXPECT_THROW(ops::cross_entropy_backward(x, good, lse_part, dloss, dx, 3, -1), Error);
  Tensor tl_bf16 = Tensor::empty({4}, DType::BF16);
  EXPECT_THROW(ops::cross_entropy_part_forward(x, good, 20, 37, lse_part, tl_bf16), Error);
  // logsumexp_combine: [P, T] parts and [T] lse of one dtype, f32 or f64.
  Tensor parts = Tensor::zeros({2, 4}, DType::F32), lse = Tensor::empty({4}, DType::F32);
  Tensor lse5 = Tensor::empty({5}, DType::F32), lse64 = Tensor::empty({4}, DType::F64);
  EXPECT_THROW(ops::logsumexp_combine(parts, lse5), Error);
  EXPECT_THROW(ops::logsumexp_combine(parts, lse64), Error);
  EXPECT_THROW(ops::logsumexp_combine(Tensor::zeros({2, 4}, DType::BF16), lse), Error);
  EXPECT_THROW(ops::logsumexp_combine(Tensor::zeros({8}, DType::F32), lse), Error);
  // combined_loss: four [T] tensors, targets i32.
  Tensor loss = Tensor::empty({4}, DType::F32);
  EXPECT_THROW(ops::cross_entropy_combined_loss(lse, tl, Tensor::zeros({4}, DType::F32), loss), Error);
  EXPECT_THROW(ops::cross_entropy_combined_loss(lse, Tensor::zeros({3}, DType::F32), good, loss), Error);
  try {
    ops::cross_entropy_combined_loss(lse, tl, good, lse64);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "cross_entropy_combined_loss: 'loss' has dtype f64; expected f32 (all statistics share one dtype)");
  }
}
