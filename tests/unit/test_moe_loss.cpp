// Load-balancing losses (aux / seq-aux / z-loss), their scores and counts, and Sinkhorn:
// values against formulas written here, f64 gradient checks, Megatron's invariants.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "moecore/ops/elementwise.h"
#include "moecore/ops/moe_loss.h"
#include "moecore/ops/router.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;
using ops::RouterScore;

namespace {

std::vector<double> ref_aux_scores(const std::vector<double>& l, int64_t T, int64_t E, RouterScore score) {
  std::vector<double> a(l.size());
  for (int64_t t = 0; t < T; ++t) {
    double z = 0;
    for (int64_t e = 0; e < E; ++e)
      z += score == RouterScore::Softmax ? std::exp(l[t * E + e]) : 1.0 / (1.0 + std::exp(-l[t * E + e]));
    for (int64_t e = 0; e < E; ++e)
      a[t * E + e] =
          (score == RouterScore::Softmax ? std::exp(l[t * E + e]) : 1.0 / (1.0 + std::exp(-l[t * E + e]))) / z;
  }
  return a;
}

// counts[g, e] through a sort per row (stable: ties to the lower id).
std::vector<double> ref_counts(const std::vector<double>& a, int64_t T, int64_t E, int64_t k, int64_t G) {
  std::vector<double> c(static_cast<size_t>(G * E), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return a[t * E + x] > a[t * E + y]; });
    for (int64_t i = 0; i < k; ++i) c[(t / (T / G)) * E + order[i]] += 1;
  }
  return c;
}

double ref_switch_loss(const std::vector<double>& a, const std::vector<double>& c, int64_t T, int64_t E, int64_t k,
                       int64_t G, double coeff) {
  const int64_t tg = T / G;
  double total = 0;
  for (int64_t g = 0; g < G; ++g) {
    double inner = 0;
    for (int64_t e = 0; e < E; ++e) {
      double p = 0;
      for (int64_t t = g * tg; t < (g + 1) * tg; ++t) p += a[t * E + e];
      inner += p * c[g * E + e];
    }
    total += static_cast<double>(E) / (static_cast<double>(k) * tg * tg) * inner;
  }
  return coeff / G * total;
}

double scalar(const Tensor& t) { return to_doubles(t)[0]; }

Tensor aux_of(const Tensor& logits, RouterScore score) {
  Tensor a = Tensor::empty(logits.shape(), logits.dtype());
  ops::aux_scores_forward(logits, score, a);
  return a;
}

Tensor counts_of(const Tensor& aux, int64_t k, int64_t G) {
  Tensor c = poisoned({G, aux.size(1)}, DType::F32);
  ops::topk_counts(aux, k, G, c);
  return c;
}

}  // namespace

TEST(MoeLoss, AuxScoresMatchFormula) {
  for (DType dt : {DType::F32, DType::F64})
    for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid}) {
      Tensor l = random_tensor({9, 12}, dt, Device::cpu(), -4, 4);
      Tensor a = poisoned({9, 12}, dt);
      ops::aux_scores_forward(l, score, a);
      ASSERT_TRUE(all_written(a));
      EXPECT_TRUE(allclose(a, Tensor::from_vector(ref_aux_scores(to_doubles(l), 9, 12, score), {9, 12}),
                           default_tolerance(dt)));
    }
}

TEST(MoeLoss, AuxScoresBackwardAccumulates) {
  for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid}) {
    Tensor l = random_tensor({5, 8}, DType::F64, Device::cpu(), -3, 3);
    Tensor da = random_tensor({5, 8}, DType::F64);
    Tensor g0 = Tensor::zeros({5, 8}, DType::F64), g1 = Tensor::zeros({5, 8}, DType::F64);
    ops::aux_scores_backward(l, score, da, g0);
    ops::fill(g1, 1.0);
    ops::aux_scores_backward(l, score, da, g1);
    const std::vector<double> a = to_doubles(g0), b = to_doubles(g1);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i] + 1.0, 1e-14);
    expect_gradients_match(
        {l}, [&](const std::vector<Tensor>& in) { return std::vector<Tensor>{aux_of(in[0], score)}; },
        [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
          Tensor dl = Tensor::zeros(in[0].shape(), DType::F64);
          ops::aux_scores_backward(in[0], score, dout[0], dl);
          return std::vector<Tensor>{dl};
        });
  }
}

TEST(MoeLoss, CountsMatchReferenceAndSumToTk) {
  for (int64_t G : {1, 4}) {
    Tensor l = random_tensor({64, 16}, DType::F32, Device::cpu(), -3, 3);
    Tensor a = aux_of(l, RouterScore::Softmax);
    Tensor c = counts_of(a, 3, G);
    ASSERT_TRUE(all_written(c));
    EXPECT_EQ(to_doubles(c), ref_counts(to_doubles(a), 64, 16, 3, G));
    const std::vector<double> cv = to_doubles(c);
    EXPECT_EQ(std::accumulate(cv.begin(), cv.end(), 0.0), 64.0 * 3);
    for (int64_t g = 0; g < G; ++g)
      EXPECT_EQ(std::accumulate(cv.begin() + g * 16, cv.begin() + (g + 1) * 16, 0.0), 64.0 / G * 3);
  }
  // Ties go to the lower expert id: all-equal scores count the first k experts.
  Tensor eq = Tensor::zeros({4, 6}, DType::F32);
  EXPECT_EQ(counts_of(eq, 2, 1).to_vector<float>(), (std::vector<float>{4, 4, 0, 0, 0, 0}));
}

// topk_counts_from_indices: the counts of a given selection, per group of T/G tokens.
TEST(MoeLoss, CountsFromIndicesMatchHandCount) {
  // 6 tokens, k = 2, E = 4, in 2 groups of 3 tokens.
  const std::vector<int32_t> sel{0, 1, 1, 2, 1, 3, /* group 1 */ 3, 2, 0, 3, 2, 1};
  Tensor idx = Tensor::from_vector(sel, {6, 2});
  Tensor c1 = poisoned({1, 4}, DType::F32), c2 = poisoned({2, 4}, DType::F32);
  ops::topk_counts_from_indices(idx, 1, c1);
  ops::topk_counts_from_indices(idx, 2, c2);
  EXPECT_EQ(c1.to_vector<float>(), (std::vector<float>{2, 4, 3, 3}));
  EXPECT_EQ(c2.to_vector<float>(), (std::vector<float>{1, 3, 1, 1, 1, 1, 2, 2}));
  // The same as topk_counts on scores whose top-k is that selection.
  Tensor l = random_tensor({64, 16}, DType::F32, Device::cpu(), -3, 3);
  Tensor a = aux_of(l, RouterScore::Softmax);
  ops::RouterConfig cfg;
  cfg.num_experts = 16;
  cfg.topk = 3;
  Tensor pr = Tensor::empty({64, 3}, DType::F32), ix = Tensor::empty({64, 3}, DType::I32);
  ops::router_topk_forward(a, Tensor(), cfg, pr, ix);
  Tensor c = Tensor::empty({4, 16}, DType::F32);
  ops::topk_counts_from_indices(ix, 4, c);
  EXPECT_EQ(to_doubles(c), ref_counts(to_doubles(a), 64, 16, 3, 4));
  // Bad arguments.
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 4}, {1, 2});
  try {
    ops::topk_counts_from_indices(bad, 1, c1);
    FAIL() << "out-of-range index accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "topk_counts_from_indices: topk_indices[0, 1] = 4 is out of range [0, 4)");
  }
  EXPECT_THROW(ops::topk_counts_from_indices(idx, 4, c1), Error);  // 6 tokens in 4 groups
  EXPECT_THROW(ops::topk_counts_from_indices(idx, 2, c1), Error);  // counts [1, 4] for 2 groups
  EXPECT_THROW(ops::topk_counts_from_indices(Tensor::zeros({6, 2}, DType::F32), 1, c1), Error);
}

TEST(MoeLoss, SwitchLossMatchesFormula) {
  for (DType dt : {DType::F32, DType::F64})
    for (int64_t G : {1, 3}) {
      Tensor a = aux_of(random_tensor({24, 10}, dt, Device::cpu(), -3, 3), RouterScore::Softmax);
      Tensor c = random_tensor({G, 10}, DType::F32, Device::cpu(), 0, 5);  // fractional (global_aux_loss)
      Tensor loss = poisoned({1}, dt);
      ops::switch_aux_loss_forward(a, c, 2, 0.01, loss);
      const double want = ref_switch_loss(to_doubles(a), to_doubles(c), 24, 10, 2, G, 0.01);
      EXPECT_NEAR(scalar(loss), want, dt == DType::F64 ? 1e-15 : 1e-7 * std::fabs(want)) << dtype_name(dt) << " G=" << G;
    }
}

TEST(MoeLoss, BalancedRoutingGivesLossEqualToCoeff) {
  // All logits equal: aux scores 1/E; force-balanced counts c_e = T k / E.
  const int64_t T = 64, E = 8, k = 2;
  for (DType dt : {DType::F32, DType::F64})
    for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid}) {
      Tensor l = Tensor::zeros({T, E}, dt);
      Tensor a = aux_of(l, score);
      for (double v : to_doubles(a)) ASSERT_EQ(v, 1.0 / E);
      for (int64_t G : {1, 4}) {
        Tensor c = Tensor::from_vector(std::vector<float>(G * E, static_cast<float>(T / G * k / E)), {G, E});
        Tensor loss = Tensor::empty({1}, dt);
        ops::switch_aux_loss_forward(a, c, k, 1.0, loss);
        EXPECT_EQ(scalar(loss), 1.0) << dtype_name(dt) << " G=" << G;
        ops::switch_aux_loss_forward(a, c, k, 0.25, loss);
        EXPECT_EQ(scalar(loss) / 0.25, 1.0);
      }
    }
}

TEST(MoeLoss, SeqAuxLossIsTheMeanOfPerSequenceAuxLosses) {
  const int64_t B = 4, S = 8, E = 6, k = 2;
  Tensor a = aux_of(random_tensor({B * S, E}, DType::F64, Device::cpu(), -3, 3), RouterScore::Sigmoid);
  Tensor c = counts_of(a, k, B);
  Tensor seq = Tensor::empty({1}, DType::F64);
  ops::switch_aux_loss_forward(a, c, k, 0.1, seq);
  double mean = 0;
  for (int64_t b = 0; b < B; ++b) {
    Tensor ab = a.slice(0, b * S, (b + 1) * S).contiguous(), cb = c.slice(0, b, b + 1).contiguous();
    Tensor lb = Tensor::empty({1}, DType::F64);
    ops::switch_aux_loss_forward(ab, cb, k, 0.1, lb);
    mean += scalar(lb) / B;
  }
  EXPECT_NEAR(scalar(seq), mean, 1e-15);
  // With one sequence (G = 1) seq_aux_loss is aux_loss: the G = 1 formula, computed independently.
  Tensor c1 = counts_of(a, k, 1), l1 = Tensor::empty({1}, DType::F64);
  ops::switch_aux_loss_forward(a, c1, k, 0.1, l1);
  double inner = 0;
  const std::vector<double> av = to_doubles(a), cv = to_doubles(c1);
  for (int64_t e = 0; e < E; ++e) {
    double p = 0;
    for (int64_t t = 0; t < B * S; ++t) p += av[t * E + e];
    inner += p * cv[e];
  }
  EXPECT_NEAR(scalar(l1), 0.1 * E / (k * double(B * S) * (B * S)) * inner, 1e-15);
}

TEST(MoeLoss, AuxLossGradientThroughScores) {
  for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid})
    for (int64_t G : {1, 3}) {
      Tensor l = random_tensor({12, 8}, DType::F64, Device::cpu(), -3, 3);
      const Tensor counts = counts_of(aux_of(l, score), 2, G);  // piecewise constant: held fixed
      SCOPED_TRACE(std::string(score == RouterScore::Softmax ? "softmax" : "sigmoid") + " G=" + std::to_string(G));
      expect_gradients_match(
          {l},
          [&](const std::vector<Tensor>& in) {
            Tensor loss = Tensor::empty({1}, DType::F64);
            ops::switch_aux_loss_forward(aux_of(in[0], score), counts, 2, 0.3, loss);
            return std::vector<Tensor>{loss};
          },
          [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
            Tensor da = poisoned({12, 8}, DType::F64), dl = Tensor::zeros({12, 8}, DType::F64);
            ops::switch_aux_loss_backward(counts, 2, 0.3, scalar(dout[0]), 12, da);
            EXPECT_TRUE(all_written(da));
            ops::aux_scores_backward(in[0], score, da, dl);
            return std::vector<Tensor>{dl};
          });
    }
}

TEST(MoeLoss, ZLossMatchesFormulaAndGradient) {
  for (DType dt : {DType::F32, DType::F64}) {
    Tensor l = random_tensor({10, 7}, dt, Device::cpu(), -5, 5);
    Tensor loss = poisoned({1}, dt);
    ops::z_loss_forward(l, 0.001, loss);
    const std::vector<double> lv = to_doubles(l);
    double want = 0;
    for (int t = 0; t < 10; ++t) {
      double z = 0;
      for (int e = 0; e < 7; ++e) z += std::exp(lv[t * 7 + e]);
      want += std::log(z) * std::log(z) / 10;
    }
    want *= 0.001;
    EXPECT_NEAR(scalar(loss), want, dt == DType::F64 ? 1e-15 : 1e-6 * want);
  }
  Tensor l = random_tensor({6, 5}, DType::F64, Device::cpu(), -3, 3);
  expect_gradients_match(
      {l},
      [](const std::vector<Tensor>& in) {
        Tensor loss = Tensor::empty({1}, DType::F64);
        ops::z_loss_forward(in[0], 0.7, loss);
        return std::vector<Tensor>{loss};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        Tensor dl = Tensor::zeros(in[0].shape(), DType::F64);
        ops::z_loss_backward(in[0], 0.7, scalar(dout[0]), dl);
        return std::vector<Tensor>{dl};
      });
}

TEST(MoeLoss, ZeroCoefficientGivesZeroGradients) {
  Tensor l = random_tensor({16, 8}, DType::F32, Device::cpu(), -3, 3);
  for (double coeff : {0.0, 0.01}) {
    Tensor a = aux_of(l, RouterScore::Softmax);
    Tensor c = counts_of(a, 2, 1);
    Tensor da = Tensor::empty({16, 8}, DType::F32), dl = Tensor::zeros({16, 8}, DType::F32);
    ops::switch_aux_loss_backward(c, 2, coeff, 1.0, 16, da);
    ops::aux_scores_backward(l, RouterScore::Softmax, da, dl);
    Tensor dz = Tensor::zeros({16, 8}, DType::F32);
    ops::z_loss_backward(l, coeff, 1.0, dz);
    auto max_abs = [](const Tensor& t) {
      double m = 0;
      for (double v : to_doubles(t)) m = std::max(m, std::fabs(v));
      return m;
    };
    if (coeff == 0) {
      EXPECT_EQ(max_abs(dl), 0.0);
      EXPECT_EQ(max_abs(dz), 0.0);
    } else {
      EXPECT_GT(max_abs(dl), 0.0);
      EXPECT_GT(max_abs(dz), 0.0);
    }
  }
}

TEST(MoeLoss, SinkhornBalancesRowsAndColumns) {
  for (DType dt : {DType::F32, DType::F64}) {
    const int64_t T = 48, E = 8;
    Tensor l = random_tensor({T, E}, dt, Device::cpu(), -2, 2);
    Tensor out = poisoned({T, E}, dt);
    ops::sinkhorn(l, out);
    ASSERT_TRUE(all_written(out));
    const std::vector<double> o = to_doubles(out);
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t t = 0; t < T; ++t) s += o[t * E + e];
      EXPECT_NEAR(s, 1.0 / E, 1e-5) << "column " << e;  // exact after the last column update, up to eps
    }
    for (int64_t t = 0; t < T; ++t) {
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += o[t * E + e];
      EXPECT_NEAR(s * T, 1.0, 2e-2) << "row " << t;  // converged to tol 1e-4 on d1
    }
    // Against Megatron's loop, written here in double. The loop stops once the mean change
    // of d1 is <= 1e-4; an f32 op's rounding can move that change across the threshold when
    // it lands within a few percent of it, and then the op stops one iteration earlier or
    // later. So each iteration's result is kept (with one iteration past the stop), and f32
    // may match a neighbour of the stopping iteration when the error there was that close.
    const std::vector<double> lv = to_doubles(l);
    std::vector<double> c(lv.size()), d0(T, 1.0), d1(E, 1.0), d1_old = d1;
    for (size_t i = 0; i < lv.size(); ++i) c[i] = std::exp(lv[i]);
    std::vector<std::vector<double>> iterate;  // the output after each iteration
    std::vector<double> errors;                // the stopping test's error after each iteration
    int stop = -1;
    while (stop < 0 || static_cast<int>(iterate.size()) <= stop + 1) {
      for (int64_t t = 0; t < T; ++t) {
        double s = 0;
        for (int64_t e = 0; e < E; ++e) s += d1[e] * c[t * E + e];
        d0[t] = (1.0 / T) / (s + 1e-8);
      }
      double error = 0;
      for (int64_t e = 0; e < E; ++e) {
        double s = 0;
        for (int64_t t = 0; t < T; ++t) s += d0[t] * c[t * E + e];
        d1[e] = (1.0 / E) / (s + 1e-8);
        error += std::fabs(d1_old[e] - d1[e]) / E;
      }
      d1_old = d1;
      std::vector<double> want(lv.size());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < E; ++e) want[t * E + e] = d1[e] * c[t * E + e] * d0[t];
      iterate.push_back(want);
      errors.push_back(error);
      if (stop < 0 && error <= 1e-4) stop = static_cast<int>(iterate.size()) - 1;
    }
    const Tolerance tol{1e-9, dt == DType::F64 ? 1e-10 : 1e-4};
    const auto near_threshold = [&](int i) { return std::fabs(errors[i] - 1e-4) <= 0.05e-4; };
    bool matched = allclose(out, Tensor::from_vector(iterate[stop], {T, E}), tol);
    if (!matched && dt == DType::F32) {
      if (near_threshold(stop)) matched = allclose(out, Tensor::from_vector(iterate[stop + 1], {T, E}), tol);
      if (!matched && stop > 0 && near_threshold(stop - 1))
        matched = allclose(out, Tensor::from_vector(iterate[stop - 1], {T, E}), tol);
    }
    EXPECT_TRUE(matched) << allclose(out, Tensor::from_vector(iterate[stop], {T, E}), tol).message() << " (stopped after "
                         << stop + 1 << " iterations, error " << errors[stop] << ")";
  }
}

TEST(MoeLoss, BadArgumentsRaise) {
  Tensor a = Tensor::zeros({10, 4}, DType::F32), loss = Tensor::empty({1}, DType::F32);
  Tensor c3 = Tensor::zeros({3, 4}, DType::F32);
  try {
    ops::switch_aux_loss_forward(a, c3, 2, 0.1, loss);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "switch_aux_loss_forward: 10 tokens do not split into 3 groups (sequences) of equal length");
  }
  EXPECT_THROW(ops::switch_aux_loss_forward(a, Tensor::zeros({1, 5}, DType::F32), 2, 0.1, loss), Error);
  Tensor loss64 = Tensor::empty({1}, DType::F64);
  EXPECT_THROW(ops::switch_aux_loss_forward(a, Tensor::zeros({1, 4}, DType::F32), 2, 0.1, loss64), Error);
  Tensor c = Tensor::empty({2, 4}, DType::F32);
  EXPECT_THROW(ops::topk_counts(a, 5, 2, c), Error);  // k > E
  EXPECT_THROW(ops::topk_counts(a, 2, 3, c), Error);  // groups do not divide T
  Tensor da = Tensor::empty({10, 4}, DType::F32);
  EXPECT_THROW(ops::switch_aux_loss_backward(Tensor::zeros({1, 4}, DType::F32), 2, 0.1, 1.0, 12, da), Error);
  Tensor bad = Tensor::empty({10, 5}, DType::F32);
  EXPECT_THROW(ops::aux_scores_forward(a, RouterScore::Softmax, bad), Error);
  EXPECT_THROW(ops::z_loss_backward(a, 0.1, 1.0, bad), Error);
  EXPECT_THROW(ops::sinkhorn(Tensor::zeros({4}, DType::F32), bad), Error);
}
