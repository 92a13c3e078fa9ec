// gpu tier: the CUDA router (every scoring option, forward and backward), the load-balancing
// losses and Sinkhorn against their CPU ops, in f32 (the router stays fp32 on the GPU).
// Indices must be equal, so the inputs are drawn without near-ties: the two devices round the
// scores differently (exp, sums in another order), and two experts whose fp64 scores are closer
// than that rounding may come out in either order (seen: 1 run in ~25 with sigmoid scores over
// 256 experts, where the top scores sit on the flat part of the sigmoid). Inputs are redrawn
// while any row's ranking that decides an output (the groups', the selection's, the aux scores')
// has two neighbours closer than 5e-7 relative (about 8 fp32 ulps: each device's scores are within
// a few ulps of the fp64 ones); Sinkhorn's selection scores likewise at 1e-4.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "moecore/ops/moe_loss.h"
#include "moecore/ops/router.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;
using ops::RouterConfig;
using ops::RouterScore;

namespace {

const Tolerance kF32{1e-5, 1e-5};
const Tolerance kExact{0, 0};

RouterConfig make(int64_t E, int64_t k, RouterScore score = RouterScore::Softmax) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = k;
  c.score = score;
  return c;
}

struct Case {
  std::string name;
  RouterConfig cfg;
  bool bias = false;
  int64_t tokens = 300;  // not a multiple of the 4 rows a block handles
};

std::vector<Case> cases() {
  std::vector<Case> v;
  v.push_back({"softmax k=8", make(64, 8)});
  v.push_back({"softmax k=1", make(64, 1)});
  RouterConfig pre = make(64, 6);
  pre.pre_softmax = true;
  v.push_back({"pre_softmax", pre});
  v.push_back({"pre_softmax bias", pre, true});
  v.push_back({"sigmoid k=1", make(64, 1, RouterScore::Sigmoid)});
  RouterConfig sig = make(256, 8, RouterScore::Sigmoid);
  sig.scaling_factor = 2.5;
  v.push_back({"sigmoid k=8 E=256 scaled", sig});
  v.push_back({"sigmoid k=8 E=256 scaled bias", sig, true});
  RouterConfig ds = make(256, 8, RouterScore::Sigmoid);  // DeepSeek-V3-like
  ds.num_groups = 8;
  ds.group_topk = 4;
  ds.scaling_factor = 2.5;
  v.push_back({"sigmoid grouped bias (DeepSeek-V3)", ds, true});
  RouterConfig gs = make(64, 4);
  gs.num_groups = 8;
  gs.group_topk = 2;
  v.push_back({"softmax grouped", gs});
  RouterConfig gp = make(60, 6);
  gp.pre_softmax = true;
  gp.num_groups = 5;
  gp.group_topk = 3;
  gp.scaling_factor = 0.5;
  v.push_back({"pre_softmax grouped odd E", gp});
  RouterConfig big = make(1024, 8);  // the largest E: fewer rows per block
  big.num_groups = 1024;
  big.group_topk = 8;
  v.push_back({"softmax E=1024 groups of one", big, false, 40});
  RouterConfig sk = make(64, 4);
  sk.sinkhorn = true;
  v.push_back({"sinkhorn k=4", sk});
  RouterConfig sk1 = make(64, 1);
  sk1.sinkhorn = true;
  v.push_back({"sinkhorn k=1", sk1});
  return v;
}

// True when every row's k+1 best sinkhorn scores are apart by more than 1e-4 relative.
bool sinkhorn_well_separated(const Tensor& logits, int64_t k) {
  Tensor l64 = Tensor::from_vector(to_doubles(logits), logits.shape());
  Tensor s = Tensor::empty(l64.shape(), DType::F64);
  ops::sinkhorn(l64, s);
  const std::vector<double> v = to_doubles(s);
  const int64_t T = logits.size(0), E = logits.size(1);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> row(v.begin() + t * E, v.begin() + (t + 1) * E);
    std::sort(row.rbegin(), row.rend());
    for (int64_t i = 0; i < std::min(k, E - 1); ++i)
      if (row[i] - row[i + 1] < 1e-4 * row[i]) return false;
  }
  return true;
}

// True when the n best of `v` (descending) are apart from each other and from the next by more
// than rel (relative to the larger); -inf entries (masked experts) are never among them.
bool best_separated(std::vector<double> v, int64_t n, double rel) {
  std::sort(v.rbegin(), v.rend());
  const int64_t m = std::min<int64_t>(n + 1, static_cast<int64_t>(v.size()));
  for (int64_t i = 0; i + 1 < m; ++i) {
    if (std::isinf(v[i + 1])) break;
    if (v[i] - v[i + 1] <= rel * std::max(std::fabs(v[i]), 1e-30)) return false;
  }
  return true;
}

// The CPU forward's rankings in fp64 (router_cpu.cpp, moe_loss.h): the group scores (sum of each
// group's topk / group_topk best), the selection scores (score + bias) of the kept groups, and the
// aux scores (softmax over E, or sigmoid normalised over E). True when none has a near-tie.
bool rankings_separated(const Tensor& logits, const Tensor& bias, const RouterConfig& cfg) {
  const std::vector<double> l = to_doubles(logits);
  const std::vector<double> b = bias.defined() ? to_doubles(bias) : std::vector<double>();
  const int64_t T = logits.size(0), E = cfg.num_experts, k = cfg.topk;
  constexpr double kRel = 5e-7;
  for (int64_t t = 0; t < T; ++t) {
    const double* row = l.data() + t * E;
    double mx = -INFINITY, z = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, row[e]);
    for (int64_t e = 0; e < E; ++e) z += std::exp(row[e] - mx);
    std::vector<double> sc(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      double v = cfg.score == RouterScore::Sigmoid ? 1.0 / (1.0 + std::exp(-row[e]))
                 : cfg.pre_softmax               ? std::exp(row[e] - mx) / z
                                                 : row[e];
      sc[static_cast<size_t>(e)] = b.empty() ? v : v + b[static_cast<size_t>(e)];
    }
    std::vector<double> aux(static_cast<size_t>(E));
    double sigmoid_sum = 0;
    for (int64_t e = 0; e < E; ++e) sigmoid_sum += 1.0 / (1.0 + std::exp(-row[e]));
    for (int64_t e = 0; e < E; ++e)
      aux[static_cast<size_t>(e)] = cfg.score == RouterScore::Sigmoid ? 1.0 / (1.0 + std::exp(-row[e])) / sigmoid_sum
                                                                      : std::exp(row[e] - mx) / z;
    if (!best_separated(aux, k, kRel)) return false;
    if (cfg.num_groups > 0) {
      const int64_t G = cfg.num_groups, per = E / G, m = k / cfg.group_topk;
      std::vector<double> group(static_cast<size_t>(G));
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> members(sc.begin() + g * per, sc.begin() + (g + 1) * per);
        if (!best_separated(members, m, kRel)) return false;
        std::sort(members.rbegin(), members.rend());
        for (int64_t i = 0; i < m; ++i) group[static_cast<size_t>(g)] += members[static_cast<size_t>(i)];
      }
      if (!best_separated(group, cfg.group_topk, kRel)) return false;
      std::vector<double> ranked = group;
      std::sort(ranked.rbegin(), ranked.rend());
      const double cut = ranked[static_cast<size_t>(cfg.group_topk - 1)];
      for (int64_t e = 0; e < E; ++e)
        if (group[static_cast<size_t>(e / per)] < cut) sc[static_cast<size_t>(e)] = -INFINITY;
    }
    if (!best_separated(sc, k, kRel)) return false;
  }
  return true;
}

struct RouterInputs {
  Tensor logits, bias;  // bias undefined unless the case has one
};

// Logits in [-4, 4], each row a random order of E values at least 4 / E apart (rank i of the row
// lies in [-4 + 8 i / E, -4 + 8 (i + 0.5) / E)): ties of the logits and of the aux scores cannot
// happen; those of biased and grouped selections are what the redraws below remove.
Tensor spaced_logits(int64_t T, int64_t E) {
  const std::vector<double> order = to_doubles(random_tensor({T, E}, DType::F64));
  const std::vector<double> jitter = to_doubles(random_tensor({T, E}, DType::F64, Device::cpu(), 0, 1));
  std::vector<float> l(static_cast<size_t>(T * E));
  std::vector<int64_t> rank(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) rank[static_cast<size_t>(e)] = e;
    const double* o = order.data() + t * E;
    std::sort(rank.begin(), rank.end(), [&](int64_t a, int64_t b) { return o[a] < o[b]; });
    for (int64_t i = 0; i < E; ++i) {
      const size_t at = static_cast<size_t>(t * E + rank[static_cast<size_t>(i)]);
      l[at] = static_cast<float>(-4.0 + 8.0 * (static_cast<double>(i) + 0.5 * jitter[at]) / static_cast<double>(E));
    }
  }
  return Tensor::from_vector(l, {T, E});
}

// Spaced logits (uniform in [-4, 4] for Sinkhorn) and an expert bias in [-0.3, 0.3], redrawn
// while a ranking has a near-tie (header comment).
RouterInputs router_inputs(const Case& c) {
  for (int attempt = 0;; ++attempt) {
    RouterInputs in;
    in.logits = c.cfg.sinkhorn ? random_tensor({c.tokens, c.cfg.num_experts}, DType::F32, Device::cpu(), -4, 4)
                               : spaced_logits(c.tokens, c.cfg.num_experts);
    if (c.bias) in.bias = random_tensor({c.cfg.num_experts}, DType::F32, Device::cpu(), -0.3, 0.3);
    const bool separated = c.cfg.sinkhorn ? sinkhorn_well_separated(in.logits, c.cfg.topk)
                                          : rankings_separated(in.logits, in.bias, c.cfg);
    if (separated) return in;
    if (attempt >= 200) {
      ADD_FAILURE() << c.name << ": no draw of inputs without near-ties in 200 attempts";
      return in;
    }
  }
}

}  // namespace

TEST(GpuRouter, ForwardMatchesCpu) {
  MC_REQUIRE_CUDA();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const int64_t T = c.tokens, E = c.cfg.num_experts, k = c.cfg.topk;
    const RouterInputs drawn = router_inputs(c);
    std::vector<Tensor> in{drawn.logits};
    if (c.bias) in.push_back(drawn.bias);
    const RouterConfig cfg = c.cfg;
    expect_cuda_matches_cpu(in, {{{T, k}, DType::F32}, {{T, k}, DType::I32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                              ops::router_topk_forward(i[0], i.size() > 1 ? i[1] : Tensor(), cfg, o[0], o[1]);
                            },
                            {kF32, kExact});
  }
}

// The fused training forward: router outputs, aux scores and their top-k in one kernel.
TEST(GpuRouter, AuxForwardMatchesCpu) {
  MC_REQUIRE_CUDA();
  for (const Case& c : cases()) {
    if (c.cfg.sinkhorn) continue;  // not for sinkhorn
    SCOPED_TRACE(c.name);
    const int64_t T = c.tokens, E = c.cfg.num_experts, k = c.cfg.topk;
    const RouterInputs drawn = router_inputs(c);
    std::vector<Tensor> in{drawn.logits};
    if (c.bias) in.push_back(drawn.bias);
    const RouterConfig cfg = c.cfg;
    expect_cuda_matches_cpu(in, {{{T, k}, DType::F32}, {{T, k}, DType::I32}, {{T, E}, DType::F32}, {{T, k}, DType::I32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                              ops::router_topk_aux_forward(i[0], i.size() > 1 ? i[1] : Tensor(), cfg, o[0], o[1],
                                                           o[2], o[3]);
                            },
                            {kF32, kExact, kF32, kExact});
  }
}

TEST(GpuRouter, BackwardMatchesCpu) {
  MC_REQUIRE_CUDA();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const int64_t T = c.tokens, E = c.cfg.num_experts, k = c.cfg.topk;
    const RouterInputs drawn = router_inputs(c);
    Tensor logits = drawn.logits;
    Tensor probs = Tensor::empty({T, k}, DType::F32), idx = Tensor::empty({T, k}, DType::I32);
    Tensor bias = drawn.bias;
    ops::router_topk_forward(logits, bias, c.cfg, probs, idx);
    Tensor dprobs = random_tensor({T, k}, DType::F32);
    const RouterConfig cfg = c.cfg;
    expect_cuda_matches_cpu({logits, idx, dprobs}, {{{T, E}, DType::F32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                              ops::router_topk_backward(i[0], i[1], i[2], cfg, o[0]);
                            },
                            {kF32});
  }
}

TEST(GpuMoeLoss, AuxScoresForwardBackwardMatchCpu) {
  MC_REQUIRE_CUDA();
  for (RouterScore score : {RouterScore::Softmax, RouterScore::Sigmoid}) {
    Tensor l = random_tensor({301, 64}, DType::F32, Device::cpu(), -4, 4);
    expect_cuda_matches_cpu({l}, {{{301, 64}, DType::F32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                              ops::aux_scores_forward(i[0], score, o[0]);
                            },
                            {kF32});
    // Backward accumulates into dl0.
    Tensor da = random_tensor({301, 64}, DType::F32), dl0 = random_tensor({301, 64}, DType::F32);
    expect_cuda_matches_cpu({l, da, dl0}, {{{301, 64}, DType::F32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                              o[0].copy_from(i[2]);
                              ops::aux_scores_backward(i[0], score, i[1], o[0]);
                            },
                            {kF32});
  }
}

TEST(GpuMoeLoss, CountsAndSwitchLossMatchCpu) {
  MC_REQUIRE_CUDA();
  // The small case runs in one token chunk; the large one in many (chunked counts and sums).
  for (const auto& [T, E, k, G] : std::vector<std::array<int64_t, 4>>{
           {512, 64, 6, 1}, {512, 64, 6, 4}, {4096, 200, 8, 1}, {4096, 200, 8, 2}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " E=" + std::to_string(E) + " G=" + std::to_string(G));
    Tensor l = random_tensor({T, E}, DType::F32, Device::cpu(), -4, 4);
    Tensor a = Tensor::empty({T, E}, DType::F32);
    ops::aux_scores_forward(l, RouterScore::Softmax, a);
    expect_cuda_matches_cpu({a}, {{{G, E}, DType::F32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                              ops::topk_counts(i[0], k, G, o[0]);
                            },
                            {kExact});
    Tensor sel = random_tensor({T, k}, DType::F32, Device::cpu(), 0, static_cast<double>(E) - 0.01);
    std::vector<int32_t> sv;
    for (double v : to_doubles(sel)) sv.push_back(static_cast<int32_t>(v));
    expect_cuda_matches_cpu({Tensor::from_vector(sv, {T, k})}, {{{G, E}, DType::F32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                              ops::topk_counts_from_indices(i[0], G, o[0]);
                            },
                            {kExact});
    Tensor c = random_tensor({G, E}, DType::F32, Device::cpu(), 0, 20);  // fractional counts
    // The loss sums T*E terms in another order than the CPU's double accumulation.
    expect_cuda_matches_cpu({a, c}, {{{1}, DType::F32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                              ops::switch_aux_loss_forward(i[0], i[1], k, 0.01, o[0]);
                            },
                            {{1e-6, 1e-5}});
    expect_cuda_matches_cpu({c}, {{{T, E}, DType::F32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                              ops::switch_aux_loss_backward(i[0], k, 0.01, 0.5, T, o[0]);
                            },
                            {kF32});
  }
}

TEST(GpuMoeLoss, ZLossMatchesCpu) {
  MC_REQUIRE_CUDA();
  Tensor l = random_tensor({777, 64}, DType::F32, Device::cpu(), -6, 6);
  expect_cuda_matches_cpu({l}, {{{1}, DType::F32}},
                          [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                            ops::z_loss_forward(i[0], 1e-3, o[0]);
                          },
                          {{1e-7, 1e-5}});
  Tensor dl0 = random_tensor({777, 64}, DType::F32);
  expect_cuda_matches_cpu({l, dl0}, {{{777, 64}, DType::F32}},
                          [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) {
                            o[0].copy_from(i[1]);
                            ops::z_loss_backward(i[0], 1e-3, 2.0, o[0]);
                          },
                          {kF32});
}

TEST(GpuMoeLoss, SinkhornMatchesCpu) {
  MC_REQUIRE_CUDA();
  for (const auto& [T, E] : std::vector<std::pair<int64_t, int64_t>>{{512, 64}, {37, 8}, {4096, 128}}) {
    SCOPED_TRACE(std::to_string(T) + "x" + std::to_string(E));
    Tensor l = random_tensor({T, E}, DType::F32, Device::cpu(), -3, 3);
    // Same iteration count on both devices (a convergence test on different rounding could
    // differ by one step only when the error lands within ~1e-6 of tol); values then agree
    // to float rounding of sums over T.
    expect_cuda_matches_cpu({l}, {{{T, E}, DType::F32}},
                            [&](const std::vector<Tensor>& i, std::vector<Tensor>& o) { ops::sinkhorn(i[0], o[0]); },
                            {{1e-9, 1e-4}});
  }
}
