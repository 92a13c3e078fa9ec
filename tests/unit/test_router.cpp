// Router top-k: every score option against an independent double-precision implementation,
// gradients against finite differences (f64), group limits, expert bias, config errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/ops/moe_loss.h"
#include "moecore/ops/router.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;
using ops::RouterConfig;
using ops::RouterScore;

namespace {

// ---- independent reference (double, std::sort based) ----------------------------------
double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The k best of v, best first, ties to the lower index (stable sort on descending value).
std::vector<int> ref_topk(const std::vector<double>& v, int k) {
  std::vector<int> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
  order.resize(k);
  return order;
}

struct RefOut {
  std::vector<double> probs;
  std::vector<int> indices;
  std::vector<double> scores;  // [T, E]: each expert's selection score (bias added, before group masking)
  std::vector<double> group_scores;  // [T, G] with groups: each group's score
};

// Reference routing for one row. sel_override: sinkhorn scores of the row (or empty).
void ref_row(const std::vector<double>& l, const std::vector<double>& bias, const std::vector<double>& sinkhorn_row,
             const RouterConfig& c, RefOut& out) {
  const int E = static_cast<int>(l.size()), k = static_cast<int>(c.topk);
  double mx = *std::max_element(l.begin(), l.end()), z = 0;
  for (double x : l) z += std::exp(x - mx);
  std::vector<double> soft(E), s(E);
  for (int e = 0; e < E; ++e) soft[e] = std::exp(l[e] - mx) / z;
  for (int e = 0; e < E; ++e) {
    if (c.sinkhorn) s[e] = sinkhorn_row[e];
    else if (c.score == RouterScore::Sigmoid) s[e] = sig(l[e]);
    else if (c.pre_softmax) s[e] = soft[e];
    else s[e] = l[e];
    if (!bias.empty()) s[e] += bias[e];
  }
  out.scores.insert(out.scores.end(), s.begin(), s.end());
  if (c.num_groups > 0) {
    const int G = static_cast<int>(c.num_groups), per = E / G, m = k / static_cast<int>(c.group_topk);
    std::vector<double> gs(G);
    for (int g = 0; g < G; ++g) {
      std::vector<double> grp(s.begin() + g * per, s.begin() + (g + 1) * per);
      std::sort(grp.rbegin(), grp.rend());
      gs[g] = std::accumulate(grp.begin(), grp.begin() + m, 0.0);
    }
    out.group_scores.insert(out.group_scores.end(), gs.begin(), gs.end());
    std::vector<int> keep = ref_topk(gs, static_cast<int>(c.group_topk));
    for (int e = 0; e < E; ++e)
      if (std::find(keep.begin(), keep.end(), e / per) == keep.end()) s[e] = -INFINITY;
  }
  const std::vector<int> idx = ref_topk(s, k);
  std::vector<double> p(k);
  if (c.sinkhorn) {
    for (int i = 0; i < k; ++i) p[i] = k > 1 ? soft[idx[i]] : sig(l[idx[i]]);
  } else if (c.score == RouterScore::Sigmoid) {
    double sum = 0;
    for (int i = 0; i < k; ++i) sum += sig(l[idx[i]]);
    for (int i = 0; i < k; ++i) p[i] = k > 1 ? sig(l[idx[i]]) / (sum + 1e-20) : sig(l[idx[i]]);
  } else if (c.pre_softmax) {
    for (int i = 0; i < k; ++i) p[i] = soft[idx[i]];
  } else {
    double sum = 0;
    for (int i = 0; i < k; ++i) sum += std::exp(l[idx[i]]);
    for (int i = 0; i < k; ++i) p[i] = std::exp(l[idx[i]]) / sum;
  }
  for (int i = 0; i < k; ++i) {
    out.probs.push_back(c.scaling_factor != 0 ? p[i] * c.scaling_factor : p[i]);
    out.indices.push_back(idx[i]);
  }
}

RefOut ref_route(const Tensor& logits, const Tensor& bias, const Tensor& sinkhorn_scores, const RouterConfig& c) {
  const std::vector<double> lv = to_doubles(logits);
  const std::vector<double> bv = bias.defined() ? to_doubles(bias) : std::vector<double>{};
  const std::vector<double> sv = sinkhorn_scores.defined() ? to_doubles(sinkhorn_scores) : std::vector<double>{};
  const int64_t T = logits.size(0), E = logits.size(1);
  RefOut out;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> row(lv.begin() + t * E, lv.begin() + (t + 1) * E);
    std::vector<double> srow = sv.empty() ? std::vector<double>{} : std::vector<double>(sv.begin() + t * E, sv.begin() + (t + 1) * E);
    ref_row(row, bv, srow, c, out);
  }
  return out;
}

RouterConfig make(int64_t E, int64_t k, RouterScore score = RouterScore::Softmax) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = k;
  c.score = score;
  return c;
}

struct Named {
  std::string name;
  RouterConfig cfg;
};

// Every score option, on 16 experts.
std::vector<Named> all_options() {
  std::vector<Named> v;
  v.push_back({"softmax k=4", make(16, 4)});
  v.push_back({"softmax k=1", make(16, 1)});
  RouterConfig pre = make(16, 4);
  pre.pre_softmax = true;
  v.push_back({"pre_softmax k=4", pre});
  v.push_back({"sigmoid k=1", make(16, 1, RouterScore::Sigmoid)});
  v.push_back({"sigmoid k=4", make(16, 4, RouterScore::Sigmoid)});
  RouterConfig scaled = make(16, 4, RouterScore::Sigmoid);
  scaled.scaling_factor = 2.5;
  v.push_back({"sigmoid k=4 scaled", scaled});
  RouterConfig scaled_soft = make(16, 2);
  scaled_soft.scaling_factor = 0.7;
  v.push_back({"softmax k=2 scaled", scaled_soft});
  RouterConfig grp = make(16, 4, RouterScore::Sigmoid);
  grp.num_groups = 4;
  grp.group_topk = 2;
  v.push_back({"sigmoid grouped", grp});
  RouterConfig grp_soft = make(16, 4);
  grp_soft.num_groups = 8;
  grp_soft.group_topk = 4;
  v.push_back({"softmax grouped", grp_soft});
  RouterConfig grp_pre = make(16, 6);
  grp_pre.pre_softmax = true;
  grp_pre.num_groups = 4;
  grp_pre.group_topk = 3;
  grp_pre.scaling_factor = 1.5;
  v.push_back({"pre_softmax grouped scaled", grp_pre});
  RouterConfig sk = make(16, 4);
  sk.sinkhorn = true;
  v.push_back({"sinkhorn k=4", sk});
  RouterConfig sk1 = make(16, 1);
  sk1.sinkhorn = true;
  v.push_back({"sinkhorn k=1", sk1});
  return v;
}

void route(const Tensor& logits, const Tensor& bias, const RouterConfig& c, Tensor& probs, Tensor& idx) {
  probs = poisoned({logits.size(0), c.topk}, logits.dtype());
  idx = poisoned({logits.size(0), c.topk}, DType::I32);
  ops::router_topk_forward(logits, bias, c, probs, idx);
}

std::vector<int> ints(const Tensor& t) { return t.to_vector<int32_t>(); }

// The op's choice equals the reference's, except that experts whose reference scores are
// within `tol` (relative) may trade places. An f32 op rounds its scores: two sigmoids of
// logits near 4 that differ by 3e-6 round to the same float, and the tie then goes to the
// lower id, while the double reference still orders them. With groups, two groups whose
// scores are that close may trade places too (their experts then differ). Exact (tol 0) for f64.
::testing::AssertionResult same_choice(const std::vector<int>& got, const RefOut& ref, const RouterConfig& c,
                                       double tol) {
  const int64_t E = c.num_experts, k = c.topk, G = c.num_groups, per = G > 0 ? E / G : E;
  const auto near = [&](double a, double b) { return std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b)); };
  if (got.size() != ref.indices.size()) return ::testing::AssertionFailure() << "index count differs";
  for (size_t t = 0; t * k < got.size(); ++t) {
    const double* s = ref.scores.data() + t * E;
    std::set<int> seen;
    for (int64_t i = 0; i < k; ++i) {
      const int g = got[t * k + i], want = ref.indices[t * k + i];
      if (g < 0 || g >= E || !seen.insert(g).second)
        return ::testing::AssertionFailure() << "token " << t << ": bad or repeated expert " << g;
      if (g == want || near(s[g], s[want])) continue;
      if (G > 0 && g / per != want / per && near(ref.group_scores[t * G + g / per], ref.group_scores[t * G + want / per]))
        continue;
      return ::testing::AssertionFailure() << "token " << t << " slot " << i << ": expert " << g << " (score "
                                           << s[g] << ") where the reference has " << want << " (score " << s[want]
                                           << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// Random f64 logits [T, E] where the routing is the same after moving any one logit by
// +-1e-4, 100 times the finite-difference step. The probabilities are only differentiable
// away from a selection boundary, and near one a central difference straddles it (sinkhorn
// scores also jump with the iteration count, hence the wide margin). Redraws until stable.
Tensor logits_away_from_ties(int64_t T, const Tensor& bias, const RouterConfig& c) {
  const int64_t E = c.num_experts;
  for (int attempt = 0; attempt < 100; ++attempt) {
    Tensor logits = random_tensor({T, E}, DType::F64, Device::cpu(), -3, 3);
    Tensor probs, idx;
    route(logits, bias, c, probs, idx);
    const std::vector<int> base = ints(idx);
    bool stable = true;
    for (int64_t i = 0; i < T * E && stable; ++i)
      for (double d : {-1e-4, 1e-4}) {
        Tensor moved = logits.clone();
        moved.data<double>()[i] += d;
        Tensor p2, i2;
        route(moved, bias, c, p2, i2);
        if (ints(i2) != base) {
          stable = false;
          break;
        }
      }
    if (stable) return logits;
  }
  ADD_FAILURE() << "no logits 1e-4 away from a selection boundary in 100 draws";
  return random_tensor({T, E}, DType::F64, Device::cpu(), -3, 3);
}

}  // namespace

TEST(Router, EveryOptionMatchesReference) {
  for (DType dt : {DType::F32, DType::F64}) {
    for (const Named& n : all_options()) {
      Tensor logits = random_tensor({37, 16}, dt, Device::cpu(), -4, 4);
      Tensor probs, idx;
      route(logits, Tensor(), n.cfg, probs, idx);
      ASSERT_TRUE(all_written(probs)) << n.name;
      ASSERT_TRUE(all_written(idx)) << n.name;
      Tensor sk;
      if (n.cfg.sinkhorn) {  // the sinkhorn scores themselves are tested in test_moe_loss.cpp
        sk = Tensor::empty(logits.shape(), dt);
        ops::sinkhorn(logits, sk);
      }
      const RefOut ref = ref_route(logits, Tensor(), sk, n.cfg);
      const double tie_tol = dt == DType::F32 ? 1e-6 : 0.0;
      EXPECT_TRUE(same_choice(ints(idx), ref, n.cfg, tie_tol)) << n.name << " " << dtype_name(dt);
      EXPECT_TRUE(allclose(probs, Tensor::from_vector(ref.probs, probs.shape()), default_tolerance(dt)))
          << n.name << " " << dtype_name(dt);
    }
  }
}

TEST(Router, HandComputedCase) {
  // Default softmax picks the two largest logits (3 and 1) and renormalises over them.
  Tensor l = Tensor::from_vector<double>({0.0, 1.0, 3.0, -2.0}, {1, 4});
  Tensor probs, idx;
  route(l, Tensor(), make(4, 2), probs, idx);
  EXPECT_EQ(ints(idx), (std::vector<int>{2, 1}));
  const double p0 = 1.0 / (1.0 + std::exp(-2.0));
  EXPECT_NEAR(probs.data<double>()[0], p0, 1e-15);
  EXPECT_NEAR(probs.data<double>()[1], 1 - p0, 1e-15);
}

TEST(Router, TiesGoToLowerExpertId) {
  Tensor l = Tensor::from_vector<float>({1, 2, 2, 0, 2, 1}, {1, 6});
  Tensor probs, idx;
  route(l, Tensor(), make(6, 4), probs, idx);
  EXPECT_EQ(ints(idx), (std::vector<int>{1, 2, 4, 0}));
  // Groups of 2 ([1,2], [2,0], [2,1]): scores 2, 2, 2 with one kept -> group 0 (lower id).
  RouterConfig g = make(6, 1);
  g.num_groups = 3;
  g.group_topk = 1;
  route(l, Tensor(), g, probs, idx);
  EXPECT_EQ(ints(idx), (std::vector<int>{1}));
}

TEST(Router, GroupLimitedUsesAtMostGroupTopkGroups) {
  for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid}) {
    RouterConfig c = make(32, 6, score);
    c.num_groups = 8;
    c.group_topk = 3;
    Tensor logits = random_tensor({200, 32}, DType::F32, Device::cpu(), -3, 3);
    Tensor probs, idx;
    route(logits, Tensor(), c, probs, idx);
    const std::vector<int> iv = ints(idx);
    size_t max_groups = 0;
    for (int t = 0; t < 200; ++t) {
      std::set<int> groups, experts;
      for (int i = 0; i < 6; ++i) {
        groups.insert(iv[t * 6 + i] / 4);
        experts.insert(iv[t * 6 + i]);
      }
      EXPECT_EQ(experts.size(), 6u) << "token " << t << " selects an expert twice";
      max_groups = std::max(max_groups, groups.size());
    }
    EXPECT_LE(max_groups, 3u);
    // Without the limit the same logits use more groups somewhere (the test can fail).
    Tensor p2, i2;
    route(logits, Tensor(), make(32, 6, score), p2, i2);
    const std::vector<int> free_idx = ints(i2);
    size_t free_max = 0;
    for (int t = 0; t < 200; ++t) {
      std::set<int> groups;
      for (int i = 0; i < 6; ++i) groups.insert(free_idx[t * 6 + i] / 4);
      free_max = std::max(free_max, groups.size());
    }
    EXPECT_GT(free_max, 3u);
  }
}

TEST(Router, ExpertBiasChangesSelectionNotProbabilities) {
  RouterConfig sigm = make(16, 4, RouterScore::Sigmoid);
  RouterConfig pre = make(16, 4);
  pre.pre_softmax = true;
  RouterConfig grp = make(16, 4, RouterScore::Sigmoid);
  grp.num_groups = 4;
  grp.group_topk = 2;
  for (const RouterConfig& c : {sigm, pre, grp}) {
    Tensor logits = random_tensor({50, 16}, DType::F64, Device::cpu(), -3, 3);
    Tensor bias = random_tensor({16}, DType::F64, Device::cpu(), -0.5, 0.5);
    Tensor probs, idx, p0, i0;
    route(logits, bias, c, probs, idx);
    route(logits, Tensor(), c, p0, i0);
    EXPECT_NE(ints(idx), ints(i0)) << "a bias of +-0.5 should change some selection";
    const RefOut ref = ref_route(logits, bias, Tensor(), c);
    EXPECT_EQ(ints(idx), ref.indices);
    EXPECT_TRUE(allclose(probs, Tensor::from_vector(ref.probs, probs.shape()), default_tolerance(DType::F64)));
    // The probabilities are the unbiased formula at the biased selection.
    const std::vector<double> lv = to_doubles(logits), pv = to_doubles(probs);
    const std::vector<int> iv = ints(idx);
    for (int t = 0; t < 50; ++t) {
      double sum = 0, mx = -INFINITY, z = 0;
      for (int e = 0; e < 16; ++e) mx = std::max(mx, lv[t * 16 + e]);
      for (int e = 0; e < 16; ++e) z += std::exp(lv[t * 16 + e] - mx);
      for (int i = 0; i < 4; ++i) sum += sig(lv[t * 16 + iv[t * 4 + i]]);
      for (int i = 0; i < 4; ++i) {
        const double l = lv[t * 16 + iv[t * 4 + i]];
        const double want = c.pre_softmax ? std::exp(l - mx) / z : sig(l) / sum;
        EXPECT_NEAR(pv[t * 4 + i], want, 1e-12);
      }
    }
  }
}

TEST(Router, BackwardMatchesFiniteDifferences) {
  for (const Named& n : all_options()) {
    const RouterConfig c = n.cfg;
    Tensor logits = logits_away_from_ties(7, Tensor(), c);
    SCOPED_TRACE(n.name);
    expect_gradients_match(
        {logits},
        [&](const std::vector<Tensor>& in) {
          Tensor probs = Tensor::empty({7, c.topk}, DType::F64), idx = Tensor::empty({7, c.topk}, DType::I32);
          ops::router_topk_forward(in[0], Tensor(), c, probs, idx);
          return std::vector<Tensor>{probs};
        },
        [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
          Tensor probs = Tensor::empty({7, c.topk}, DType::F64), idx = Tensor::empty({7, c.topk}, DType::I32);
          ops::router_topk_forward(in[0], Tensor(), c, probs, idx);
          Tensor dl = poisoned({7, 16}, DType::F64);
          ops::router_topk_backward(in[0], idx, dout[0], c, dl);
          EXPECT_TRUE(all_written(dl));
          return std::vector<Tensor>{dl};
        });
  }
}

TEST(Router, BackwardWithExpertBias) {
  RouterConfig c = make(16, 4, RouterScore::Sigmoid);
  c.num_groups = 4;
  c.group_topk = 2;
  c.scaling_factor = 2.0;
  Tensor bias = random_tensor({16}, DType::F64, Device::cpu(), -0.5, 0.5);
  Tensor logits = logits_away_from_ties(6, bias, c);
  expect_gradients_match(
      {logits},
      [&](const std::vector<Tensor>& in) {
        Tensor probs = Tensor::empty({6, 4}, DType::F64), idx = Tensor::empty({6, 4}, DType::I32);
        ops::router_topk_forward(in[0], bias, c, probs, idx);
        return std::vector<Tensor>{probs};
      },
      [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        Tensor probs = Tensor::empty({6, 4}, DType::F64), idx = Tensor::empty({6, 4}, DType::I32);
        ops::router_topk_forward(in[0], bias, c, probs, idx);
        Tensor dl = Tensor::empty({6, 16}, DType::F64);
        ops::router_topk_backward(in[0], idx, dout[0], c, dl);
        return std::vector<Tensor>{dl};
      });
}

TEST(Router, UnselectedLogitsGetZeroGradientUnlessFormulaUsesAll) {
  Tensor logits = random_tensor({5, 16}, DType::F64, Device::cpu(), -3, 3);
  for (const Named& n : all_options()) {
    Tensor probs, idx;
    route(logits, Tensor(), n.cfg, probs, idx);
    Tensor dl = Tensor::empty({5, 16}, DType::F64);
    ops::router_topk_backward(logits, idx, random_tensor(probs.shape(), DType::F64), n.cfg, dl);
    const std::vector<double> g = to_doubles(dl);
    const std::vector<int> iv = ints(idx);
    const bool all_e = n.cfg.pre_softmax || (n.cfg.sinkhorn && n.cfg.topk > 1);
    int nonzero_unselected = 0;
    for (int t = 0; t < 5; ++t)
      for (int e = 0; e < 16; ++e) {
        const bool sel = std::find(iv.begin() + t * n.cfg.topk, iv.begin() + (t + 1) * n.cfg.topk, e) !=
                         iv.begin() + (t + 1) * n.cfg.topk;
        if (!sel && g[t * 16 + e] != 0) ++nonzero_unselected;
      }
    if (all_e) EXPECT_GT(nonzero_unselected, 0) << n.name;
    else EXPECT_EQ(nonzero_unselected, 0) << n.name;
  }
}

// The router flags are checked by the model config (validate_moe_config, model/config.h), by name.
TEST(Router, BadConfigsNameTheFlag) {
  auto expect_flag = [](RouterConfig c, const std::string& flag) {
    try {
      MoeConfig moe;
      moe.num_experts = c.num_experts;
      moe.router = c;
      if (c.sinkhorn) moe.load_balancing = LoadBalancing::Sinkhorn;
      validate_moe_config(moe, 64);
      ADD_FAILURE() << "expected an Error naming " << flag;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  expect_flag(make(8, 9), "--moe-router-topk");
  expect_flag(make(8, 0), "--moe-router-topk");
  expect_flag(make(0, 1), "--num-experts");
  RouterConfig c = make(16, 4);
  c.num_groups = 3;
  c.group_topk = 1;
  expect_flag(c, "--moe-router-num-groups");
  c.num_groups = 4;
  c.group_topk = 5;
  expect_flag(c, "--moe-router-group-topk");
  c.group_topk = 3;
  expect_flag(c, "--moe-router-group-topk");  // 4 % 3 != 0
  c = make(16, 8);
  c.num_groups = 8;
  c.group_topk = 2;  // 4 per kept group, groups hold 2
  expect_flag(c, "--moe-router-topk");
  c = make(16, 4);
  c.group_topk = 2;  // without groups
  expect_flag(c, "--moe-router-num-groups");
  c = make(16, 4);
  c.scaling_factor = -1;
  expect_flag(c, "--moe-router-topk-scaling-factor");
  c = make(16, 4, RouterScore::Sigmoid);
  c.pre_softmax = true;
  expect_flag(c, "--moe-router-pre-softmax");
  c = make(16, 4);
  c.sinkhorn = true;
  c.num_groups = 4;
  c.group_topk = 2;
  expect_flag(c, "sinkhorn");
  try {
    validate_router_flags(make(8, 9));
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "router config: --moe-router-topk 9 must be in [1, --num-experts 8]");
  }
}

TEST(Router, BadArgumentsRaise) {
  Tensor logits = Tensor::zeros({4, 8}, DType::F32);
  Tensor probs = Tensor::empty({4, 2}, DType::F32), idx = Tensor::empty({4, 2}, DType::I32);
  RouterConfig c = make(8, 2);
  // Expert bias with the default softmax router.
  try {
    ops::router_topk_forward(logits, Tensor::zeros({8}, DType::F32), c, probs, idx);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--moe-router-enable-expert-bias"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ops::router_topk_forward(logits, Tensor(), make(16, 2), probs, idx), Error);  // E mismatch
  Tensor idx64 = Tensor::empty({4, 2}, DType::I64);
  EXPECT_THROW(ops::router_topk_forward(logits, Tensor(), c, probs, idx64), Error);
  Tensor probs3 = Tensor::empty({4, 3}, DType::F32);
  EXPECT_THROW(ops::router_topk_forward(logits, Tensor(), c, probs3, idx), Error);
  Tensor bf = Tensor::zeros({4, 8}, DType::BF16);
  EXPECT_THROW(ops::router_topk_forward(bf, Tensor(), c, probs, idx), Error);
  RouterConfig s = make(8, 2, RouterScore::Sigmoid);
  EXPECT_THROW(ops::router_topk_forward(logits, Tensor::zeros({7}, DType::F32), s, probs, idx), Error);
  Tensor dl = Tensor::empty({4, 8}, DType::F32);
  EXPECT_THROW(ops::router_topk_backward(logits, idx, Tensor::empty({4, 3}, DType::F32), c, dl), Error);
}

// router_topk_aux_forward: the router outputs equal router_topk_forward's exactly; the aux
// scores follow their formula (softmax, or sigmoid normalised over E; no bias) and the aux
// indices are the reference top-k of those scores.
TEST(Router, AuxForwardEqualsRouterAndAuxScoresTopk) {
  std::vector<std::pair<RouterConfig, bool>> configs;  // (config, expert bias)
  configs.push_back({make(16, 4), false});
  RouterConfig pre = make(16, 3);
  pre.pre_softmax = true;
  configs.push_back({pre, true});
  configs.push_back({make(12, 2, RouterScore::Sigmoid), true});
  RouterConfig grouped = make(16, 4, RouterScore::Sigmoid);
  grouped.num_groups = 4;
  grouped.group_topk = 2;
  grouped.scaling_factor = 2.0;
  configs.push_back({grouped, true});
  for (DType dt : {DType::F32, DType::F64})
    for (const auto& [c, with_bias] : configs) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " E=" + std::to_string(c.num_experts) +
                   " k=" + std::to_string(c.topk) + (with_bias ? " bias" : ""));
      const int64_t T = 37, E = c.num_experts, k = c.topk;
      Tensor logits = random_tensor({T, E}, dt, Device::cpu(), -3, 3);
      Tensor bias = with_bias ? random_tensor({E}, dt, Device::cpu(), -0.2, 0.2) : Tensor();
      Tensor probs = poisoned({T, k}, dt), idx = poisoned({T, k}, DType::I32);
      Tensor aux = poisoned({T, E}, dt), aux_idx = poisoned({T, k}, DType::I32);
      ops::router_topk_aux_forward(logits, bias, c, probs, idx, aux, aux_idx);
      Tensor p0 = Tensor::empty({T, k}, dt), i0 = Tensor::empty({T, k}, DType::I32);
      ops::router_topk_forward(logits, bias, c, p0, i0);
      EXPECT_EQ(to_doubles(probs), to_doubles(p0));
      EXPECT_EQ(idx.to_vector<int32_t>(), i0.to_vector<int32_t>());
      const std::vector<double> l = to_doubles(logits), a = to_doubles(aux);
      const std::vector<int32_t> ai = aux_idx.to_vector<int32_t>();
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> f(static_cast<size_t>(E));
        double z = 0;
        for (int64_t e = 0; e < E; ++e) {
          f[e] = c.score == RouterScore::Softmax ? std::exp(l[t * E + e]) : sig(l[t * E + e]);
          z += f[e];
        }
        std::vector<double> row(a.begin() + t * E, a.begin() + (t + 1) * E);
        for (int64_t e = 0; e < E; ++e) EXPECT_NEAR(row[e], f[e] / z, 1e-6) << "t=" << t << " e=" << e;
        const std::vector<int> want = ref_topk(row, static_cast<int>(k));
        for (int64_t j = 0; j < k; ++j) EXPECT_EQ(ai[t * k + j], want[j]) << "t=" << t << " j=" << j;
      }
    }
}

TEST(Router, AuxForwardBadArgumentsRaise) {
  Tensor logits = Tensor::zeros({4, 8}, DType::F32);
  Tensor probs = Tensor::empty({4, 2}, DType::F32), idx = Tensor::empty({4, 2}, DType::I32);
  Tensor aux = Tensor::empty({4, 8}, DType::F32), aux_idx = Tensor::empty({4, 2}, DType::I32);
  RouterConfig sk = make(8, 2);
  sk.sinkhorn = true;
  try {
    ops::router_topk_aux_forward(logits, Tensor(), sk, probs, idx, aux, aux_idx);
    FAIL() << "sinkhorn accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "router_topk_aux_forward: not for the sinkhorn router (use router_topk_forward and aux_scores_forward)");
  }
  Tensor aux_bad = Tensor::empty({4, 7}, DType::F32), aux_idx_bad = Tensor::empty({4, 3}, DType::I32);
  EXPECT_THROW(ops::router_topk_aux_forward(logits, Tensor(), make(8, 2), probs, idx, aux_bad, aux_idx), Error);
  EXPECT_THROW(ops::router_topk_aux_forward(logits, Tensor(), make(8, 2), probs, idx, aux, aux_idx_bad), Error);
  EXPECT_THROW(ops::router_topk_aux_forward(logits, Tensor::zeros({8}, DType::F32), make(8, 2), probs, idx, aux, aux_idx),
               Error);  // bias with the default softmax router
}
