// MoeLayer on its own, in f64 on the CPU: force-balanced routing (loss exactly 1, no router
// gradient), the balancing-loss coefficients, the aux-loss-free expert-bias update, capacity with
// and without padding, shared experts (gated and not) and experts that receive no tokens.
// Facts held here are behaviours Megatron's own MoE tests hold (e.g. force-balanced routing gives
// a balancing loss of exactly 1; expert-bias counts sum to T x k; capacity bounds hold).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "moecore/model/config.h"
#include "moecore/model/params.h"
#include "moecore/moe/moe_layer.h"
#include "op_harness.h"

using namespace moecore;
using moecore::testing::random_tensor;
using moecore::testing::to_doubles;

namespace {

constexpr int64_t kHidden = 8;

// E experts, top-k, expert FFN 6, SwiGLU, no biases; weights large enough that every path matters.
ModelConfig moe_config(int64_t experts = 4, int64_t topk = 2) {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = kHidden;
  c.num_attention_heads = 2;
  c.seq_length = 6;
  c.vocab_size = 11;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.init_method_std = 0.3;
  c.moe.num_experts = experts;
  c.moe.router.topk = topk;
  c.moe.ffn_hidden_size = 6;
  return c;
}

// A layer named "moe" over its own f64 store; the same seed gives the same values to parameters
// of the same name (Philox keyed by name), so layers built from different configs share weights.
struct Built {
  std::unique_ptr<ParamStore> store;
  std::unique_ptr<MoeLayer> layer;
  Param& param(const std::string& suffix) { return store->get("moe." + suffix); }
  std::vector<double> grad(const std::string& suffix) { return param(suffix).grad.to_vector<double>(); }
};

Built build(ModelConfig c, uint64_t seed = 42) {
  finalize_model_config(c, "1");
  Built b;
  b.store = std::make_unique<ParamStore>(Device::cpu(), DType::F64, DType::F64, seed);
  b.layer = std::make_unique<MoeLayer>(*b.store, "moe", c);
  b.store->initialize();
  return b;
}

void set_values(Tensor& t, const std::vector<double>& v) { t.copy_from(Tensor::from_vector(v, t.shape())); }

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

double dot(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = to_doubles(a), y = to_doubles(b);
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// Holds d<dy, out>/d param to central differences at `samples` spread positions of each named
// parameter (training forward, no balancing losses in the objective: give coefficients 0).
void expect_param_gradients(Built& b, const Tensor& x, int64_t batch, const Tensor& dy,
                            const std::vector<std::string>& names, int samples = 6) {
  b.store->zero_grad();
  MoeLayer::Ctx ctx;
  b.layer->forward(x, batch, true, 3, ctx);
  b.layer->backward(dy, 1.0, ctx);
  for (const std::string& name : names) {
    Param& p = b.param(name);
    const std::vector<double> grad = p.grad.to_vector<double>();
    const int64_t n = p.master.numel();
    for (int s = 0; s < samples; ++s) {
      const int64_t i = (s * 7919 + 3) % n;
      double* w = p.master.data<double>() + i;
      const double orig = *w, h = 1e-6;
      auto objective = [&] {
        b.store->refresh_compute_weights();
        MoeLayer::Ctx c;
        return dot(b.layer->forward(x, batch, true, 3, c), dy);
      };
      *w = orig + h;
      const double up = objective();
      *w = orig - h;
      const double down = objective();
      *w = orig;
      b.store->refresh_compute_weights();
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(grad[static_cast<size_t>(i)], numeric, 1e-7 + 1e-5 * std::fabs(numeric)) << name << "[" << i << "]";
    }
  }
}

// expect_gradients_match over x: d<w, out>/dx through the layer's forward and backward.
void expect_input_gradients(Built& b, int64_t tokens, int64_t batch) {
  MoeLayer& layer = *b.layer;
  moecore::testing::expect_gradients_match(
      {random_tensor({tokens, kHidden}, DType::F64)},
      [&](const std::vector<Tensor>& in) {
        MoeLayer::Ctx c;
        return std::vector<Tensor>{layer.forward(in[0], batch, true, 3, c)};
      },
      [&](const std::vector<Tensor>& in, const std::vector<Tensor>& g) {
        MoeLayer::Ctx c;
        layer.forward(in[0], batch, true, 3, c);
        return std::vector<Tensor>{layer.backward(g[0], 1.0, c)};
      });
}

}  // namespace

// ---- force-balanced routing -----------------------------------------------------------------

// With E | T*k every expert gets T*k/E tokens and L/coeff = E * sum_e f_e P_e = 1 exactly (f_e =
// 1/E, sum_e P_e = 1), for every loss type (seq_aux_loss: E | S*k, so each sequence is balanced).
TEST(MoeLayer, ForceBalancingGivesLossOneAndEqualCounts) {
  struct Case {
    LoadBalancing lb;
    ops::RouterScore score;
  };
  for (const Case cs : {Case{LoadBalancing::AuxLoss, ops::RouterScore::Softmax},
                        Case{LoadBalancing::SeqAuxLoss, ops::RouterScore::Softmax},
                        Case{LoadBalancing::GlobalAuxLoss, ops::RouterScore::Softmax},
                        Case{LoadBalancing::AuxLoss, ops::RouterScore::Sigmoid}}) {
    SCOPED_TRACE(load_balancing_name(cs.lb));
    ModelConfig c = moe_config(4, 2);
    c.moe.force_load_balancing = true;
    c.moe.load_balancing = cs.lb;
    c.moe.router.score = cs.score;
    c.moe.aux_loss_coeff = 0.01;
    Built b = build(c);
    const int64_t batch = 2, seq = 6, tokens = batch * seq;  // T*k = 24, S*k = 12: both divisible by 4
    MoeLayer::Ctx ctx;
    b.layer->forward(random_tensor({tokens, kHidden}, DType::F64), batch, true, 1, ctx);
    EXPECT_NEAR(b.layer->stats().aux_loss, 1.0, 1e-12);
    EXPECT_EQ(b.layer->stats().micro_batches, 1);
    ASSERT_EQ(b.layer->stats().tokens_per_expert.size(), 4u);
    for (double n : b.layer->stats().tokens_per_expert) EXPECT_EQ(n, tokens * 2 / 4);
    // A second micro-batch of the same step: the statistics add up (and global_aux_loss averages
    // its counts over both, still balanced).
    MoeLayer::Ctx ctx2;
    b.layer->forward(random_tensor({tokens, kHidden}, DType::F64), batch, true, 2, ctx2);
    EXPECT_NEAR(b.layer->stats().aux_loss, 2.0, 1e-12);
    for (double n : b.layer->stats().tokens_per_expert) EXPECT_EQ(n, 2 * tokens * 2 / 4);
  }
}

TEST(MoeLayer, ForceBalancingGivesNoRouterGradient) {
  for (bool force : {true, false}) {
    SCOPED_TRACE(force ? "forced" : "learned routing");
    ModelConfig c = moe_config(4, 2);
    c.moe.force_load_balancing = force;
    c.moe.aux_loss_coeff = 0.1;
    c.moe.z_loss_coeff = 0.1;
    Built b = build(c);
    const Tensor x = random_tensor({12, kHidden}, DType::F64);
    MoeLayer::Ctx ctx;
    const Tensor y = b.layer->forward(x, 2, true, 1, ctx);
    b.layer->backward(random_tensor(y.shape(), DType::F64), 1.0, ctx);
    const double router = max_abs(b.grad("router.weight"));
    if (force) {
      EXPECT_EQ(router, 0.0);
    } else {
      EXPECT_GT(router, 1e-4);
    }
    EXPECT_GT(max_abs(b.grad("experts.linear_fc1.weight")), 1e-4);  // the experts still learn
  }
}

// ---- balancing-loss coefficients ------------------------------------------------------------

// Coefficients 0: the router gradient is that of the layer output alone (finite differences of
// <dy, out>); a positive aux or z coefficient changes it and leaves the expert gradients alone.
TEST(MoeLayer, ZeroCoefficientsLeaveOnlyTheOutputGradient) {
  ModelConfig c = moe_config(4, 2);
  c.moe.aux_loss_coeff = 0.0;
  c.moe.z_loss_coeff = 0.0;
  Built base = build(c);
  // Perfectly balanced counts make the aux loss constant in the logits (zero gradient): draw
  // inputs until the selection is unbalanced.
  Tensor x;
  for (int tries = 0; tries < 50; ++tries) {
    x = random_tensor({12, kHidden}, DType::F64);
    MoeLayer::Ctx ctx;
    base.layer->forward(x, 2, true, 3, ctx);
    const MoeStepStats s = base.layer->finish_step();
    if (s.tokens_per_expert != std::vector<double>(4, 6.0)) break;
  }
  const Tensor dy = random_tensor({12, kHidden}, DType::F64);
  expect_param_gradients(base, x, 2, dy, {"router.weight"});
  const std::vector<double> g0 = base.grad("router.weight"), fc0 = base.grad("experts.linear_fc1.weight");
  EXPECT_GT(max_abs(g0), 1e-4);

  for (LoadBalancing lb : {LoadBalancing::AuxLoss, LoadBalancing::SeqAuxLoss, LoadBalancing::GlobalAuxLoss}) {
    for (bool z : {false, true}) {
      SCOPED_TRACE(std::string(load_balancing_name(lb)) + (z ? " z-loss" : " aux loss"));
      ModelConfig ci = c;
      ci.moe.load_balancing = lb;
      (z ? ci.moe.z_loss_coeff : ci.moe.aux_loss_coeff) = 0.5;
      Built b = build(ci);
      MoeLayer::Ctx ctx;
      b.layer->forward(x, 2, true, 3, ctx);
      b.layer->backward(dy, 1.0, ctx);
      EXPECT_GT(max_abs_diff(b.grad("router.weight"), g0), 1e-6);
      EXPECT_LT(max_abs_diff(b.grad("experts.linear_fc1.weight"), fc0), 1e-13);
    }
  }
}

// ---- aux-loss-free expert bias --------------------------------------------------------------

TEST(MoeLayer, ExpertBiasMovesByRateTimesSignOfImbalance) {
  ModelConfig c = moe_config(4, 2);
  c.moe.router.score = ops::RouterScore::Sigmoid;
  c.moe.enable_expert_bias = true;
  c.moe.bias_update_rate = 0.01;
  Built b = build(c);
  Tensor& bias = b.param("router.expert_bias").master;
  // Expert 0 favoured, expert 3 disfavoured: some counts lie above and some below the mean.
  const std::vector<double> before = {0.3, 0.0, 0.05, -0.3};
  set_values(bias, before);
  std::vector<double> counted(4, 0.0);
  for (int m = 0; m < 2; ++m) {  // two micro-batches of one step
    MoeLayer::Ctx ctx;
    b.layer->forward(random_tensor({12, kHidden}, DType::F64), 2, true, static_cast<uint64_t>(m), ctx);
    for (int32_t e : ctx.router.indices.to_vector<int32_t>()) counted[static_cast<size_t>(e)] += 1;
  }
  const std::vector<double> c_e = b.layer->stats().tokens_per_expert;
  ASSERT_EQ(c_e, counted);  // the statistics are the selections of both micro-batches
  double mean = 0;
  for (double v : c_e) mean += v / 4.0;
  EXPECT_EQ(mean, 2 * 12 * 2 / 4.0);
  int up = 0, down = 0;
  std::vector<double> expected = before;
  for (size_t e = 0; e < 4; ++e) {
    const double sign = mean > c_e[e] ? 1.0 : (mean < c_e[e] ? -1.0 : 0.0);
    up += sign > 0;
    down += sign < 0;
    expected[e] += 0.01 * sign;
  }
  ASSERT_GT(up, 0) << "test setup: no expert below the mean";
  ASSERT_GT(down, 0) << "test setup: no expert above the mean";

  const MoeStepStats step = b.layer->finish_step();
  EXPECT_EQ(step.tokens_per_expert, c_e);
  EXPECT_EQ(step.micro_batches, 2);
  const std::vector<double> after = bias.to_vector<double>();
  for (size_t e = 0; e < 4; ++e) EXPECT_NEAR(after[e], expected[e], 1e-15) << "expert " << e;
  // The statistics restart; a step without forwards leaves the bias where it is.
  EXPECT_EQ(b.layer->stats().tokens_per_expert, std::vector<double>(4, 0.0));
  EXPECT_EQ(b.layer->stats().micro_batches, 0);
  b.layer->finish_step();
  EXPECT_EQ(bias.to_vector<double>(), after);
}

// Balanced counts (forced routing; a small bias does not change its selection): sign 0, no move.
TEST(MoeLayer, ExpertBiasStaysWhenCountsAreBalanced) {
  ModelConfig c = moe_config(4, 2);
  c.moe.router.score = ops::RouterScore::Sigmoid;
  c.moe.enable_expert_bias = true;
  c.moe.bias_update_rate = 0.01;
  c.moe.force_load_balancing = true;
  Built b = build(c);
  Tensor& bias = b.param("router.expert_bias").master;
  const std::vector<double> before = {0.01, -0.01, 0.005, 0.0};
  set_values(bias, before);
  MoeLayer::Ctx ctx;
  b.layer->forward(random_tensor({12, kHidden}, DType::F64), 2, true, 1, ctx);
  EXPECT_EQ(b.layer->finish_step().tokens_per_expert, std::vector<double>(4, 6.0));
  EXPECT_EQ(bias.to_vector<double>(), before);
}

// ---- capacity -------------------------------------------------------------------------------

// Drop-and-pad equals dropping without padding (padding rows carry nothing), outputs and all
// gradients, for both drop policies; and the drops do change the output (vs dropless).
TEST(MoeLayer, CapacityPaddedMatchesUnpadded) {
  const int64_t tokens = 12, k = 2, e = 4;
  for (ops::DropPolicy policy : {ops::DropPolicy::Probs, ops::DropPolicy::Position}) {
    SCOPED_TRACE(policy == ops::DropPolicy::Probs ? "probs" : "position");
    ModelConfig c = moe_config(e, k);
    c.moe.capacity_factor = 0.5;  // C = ceil(12 * 2 / 4 * 0.5) = 3: 12 of 24 slots
    c.moe.drop_policy = policy;
    c.moe.aux_loss_coeff = 0.1;
    const int64_t capacity = ops::expert_capacity(tokens, k, e, 0.5);
    ASSERT_EQ(capacity, 3);
    ModelConfig cp = c;
    cp.moe.pad_to_capacity = true;
    ModelConfig cd = c;
    cd.moe.capacity_factor = 0.0;
    Built unpadded = build(c), padded = build(cp), dropless = build(cd);
    const Tensor x = random_tensor({tokens, kHidden}, DType::F64);
    const Tensor dy = random_tensor({tokens, kHidden}, DType::F64);

    MoeLayer::Ctx cu, cpd, cdl;
    const Tensor yu = unpadded.layer->forward(x, 2, true, 1, cu);
    const Tensor yp = padded.layer->forward(x, 2, true, 1, cpd);
    const Tensor yd = dropless.layer->forward(x, 2, true, 1, cdl);
    EXPECT_LE(cu.dispatch.routing.num_rows, e * capacity);
    EXPECT_EQ(cpd.dispatch.routing.num_rows, e * capacity);
    EXPECT_EQ(cpd.dispatch.routing.host_tokens_per_expert, std::vector<int64_t>(4, capacity));
    EXPECT_EQ(cdl.dispatch.routing.num_rows, tokens * k);
    EXPECT_TRUE(moecore::testing::allclose(yp, yu, {1e-13, 1e-12}));
    EXPECT_GT(max_abs_diff(to_doubles(yu), to_doubles(yd)), 1e-6) << "capacity dropped nothing";

    const Tensor dxu = unpadded.layer->backward(dy, 1.0, cu);
    const Tensor dxp = padded.layer->backward(dy, 1.0, cpd);
    EXPECT_TRUE(moecore::testing::allclose(dxp, dxu, {1e-13, 1e-12}));
    for (const char* name : {"router.weight", "experts.linear_fc1.weight", "experts.linear_fc2.weight"})
      EXPECT_LT(max_abs_diff(padded.grad(name), unpadded.grad(name)), 1e-13) << name;
    // The padded layer's gradients (without the aux loss, which is not part of <w, out>).
    ModelConfig cg = cp;
    cg.moe.aux_loss_coeff = 0.0;
    Built for_check = build(cg);
    expect_input_gradients(for_check, tokens, 2);
    expect_param_gradients(for_check, x, 2, dy, {"router.weight", "experts.linear_fc1.weight", "experts.linear_fc2.weight"});
  }
}

// ---- shared experts -------------------------------------------------------------------------

namespace {
// The shared expert by hand: sigmoid(x g^T) (when gated) * W2 (silu(x W1a^T) * x W1b^T).
std::vector<double> shared_expert_reference(Built& b, const Tensor& x, bool gated, int64_t f) {
  const std::vector<double> xs = to_doubles(x),
                            w1v = b.param("shared_experts.linear_fc1.weight").master.to_vector<double>(),
                            w2 = b.param("shared_experts.linear_fc2.weight").master.to_vector<double>();
  std::vector<double> g;
  if (gated) g = b.param("shared_experts.gate.weight").master.to_vector<double>();
  const int64_t tokens = x.size(0), h = kHidden;
  std::vector<double> out(static_cast<size_t>(tokens * h), 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> act(static_cast<size_t>(f));
    for (int64_t i = 0; i < f; ++i) {
      double a = 0, u = 0;
      for (int64_t j = 0; j < h; ++j) {
        a += w1v[static_cast<size_t>(i * h + j)] * xs[static_cast<size_t>(t * h + j)];
        u += w1v[static_cast<size_t>((f + i) * h + j)] * xs[static_cast<size_t>(t * h + j)];
      }
      act[static_cast<size_t>(i)] = a / (1 + std::exp(-a)) * u;
    }
    double scale = 1;
    if (gated) {
      double z = 0;
      for (int64_t j = 0; j < h; ++j) z += g[static_cast<size_t>(j)] * xs[static_cast<size_t>(t * h + j)];
      scale = 1 / (1 + std::exp(-z));
    }
    for (int64_t o = 0; o < h; ++o) {
      double s = 0;
      for (int64_t i = 0; i < f; ++i) s += w2[static_cast<size_t>(o * f + i)] * act[static_cast<size_t>(i)];
      out[static_cast<size_t>(t * h + o)] = scale * s;
    }
  }
  return out;
}
}  // namespace

TEST(MoeLayer, SharedExpertAddsItsOutputToTheRoutedOne) {
  const int64_t f = 5;
  const Tensor x = random_tensor({12, kHidden}, DType::F64);
  ModelConfig c = moe_config(4, 2);
  Built routed = build(c);
  MoeLayer::Ctx c0;
  const std::vector<double> y0 = to_doubles(routed.layer->forward(x, 2, true, 1, c0));
  for (bool gated : {false, true}) {
    SCOPED_TRACE(gated ? "gated" : "ungated");
    ModelConfig cs = c;
    cs.moe.shared_expert_size = f;
    cs.moe.shared_expert_gate = gated;
    Built b = build(cs);  // same seed: the routed experts and router are those of `routed`
    MoeLayer::Ctx ctx;
    const std::vector<double> y = to_doubles(b.layer->forward(x, 2, true, 1, ctx));
    const std::vector<double> shared = shared_expert_reference(b, x, gated, f);
    ASSERT_EQ(y.size(), shared.size());
    EXPECT_GT(max_abs(shared), 1e-3);
    for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], y0[i] + shared[i], 1e-12) << i;
  }
}

TEST(MoeLayer, SharedGatedExpertGradients) {
  ModelConfig c = moe_config(4, 2);
  c.moe.shared_expert_size = 5;
  c.moe.shared_expert_gate = true;
  Built b = build(c);
  expect_input_gradients(b, 12, 2);
  expect_param_gradients(b, random_tensor({12, kHidden}, DType::F64), 2, random_tensor({12, kHidden}, DType::F64),
                         {"shared_experts.gate.weight", "shared_experts.linear_fc1.weight",
                          "shared_experts.linear_fc2.weight", "router.weight", "experts.linear_fc1.weight"});
}

// ---- experts without tokens -----------------------------------------------------------------

// A large expert bias sends every token to expert 0 (k = 1) or to experts 0 and 1 (k = 2): the
// others get no rows; forward and backward still work, their weight gradients are exactly 0.
TEST(MoeLayer, ExpertsWithoutTokens) {
  struct Case {
    int64_t k;
    double capacity_factor;
    bool pad;
  };
  for (const Case cs : {Case{1, 0.0, false}, Case{2, 0.0, false}, Case{1, 1.0, false}, Case{2, 1.0, true}}) {
    SCOPED_TRACE("k=" + std::to_string(cs.k) + " cf=" + std::to_string(cs.capacity_factor) + (cs.pad ? " padded" : ""));
    ModelConfig c = moe_config(4, cs.k);
    c.moe.router.score = ops::RouterScore::Sigmoid;
    c.moe.enable_expert_bias = true;
    c.moe.bias_update_rate = 0.0;
    c.moe.capacity_factor = cs.capacity_factor;
    c.moe.pad_to_capacity = cs.pad;
    Built b = build(c);
    set_values(b.param("router.expert_bias").master, {100.0, 50.0, 0.0, 0.0});
    const int64_t tokens = 12;
    const Tensor x = random_tensor({tokens, kHidden}, DType::F64);
    MoeLayer::Ctx ctx;
    const Tensor y = b.layer->forward(x, 2, true, 1, ctx);
    // Counts are taken after capacity dropping (Megatron counts its final routing map): with a
    // capacity, each chosen expert keeps C = ceil(T k / E * cf) of its 12 tokens.
    const int64_t kept = cs.capacity_factor > 0 ? ops::expert_capacity(tokens, cs.k, 4, cs.capacity_factor) : tokens;
    std::vector<double> expected_counts(4, 0.0);
    for (int64_t j = 0; j < cs.k; ++j) expected_counts[static_cast<size_t>(j)] = static_cast<double>(kept);
    EXPECT_EQ(b.layer->stats().tokens_per_expert, expected_counts);
    const Tensor dx = b.layer->backward(random_tensor(y.shape(), DType::F64), 1.0, ctx);
    EXPECT_TRUE(moecore::testing::all_written(dx));
    // fc1 [E, 2F, H]: per expert blocks of 12 * 8 gradients
    const std::vector<double> g = b.grad("experts.linear_fc1.weight");
    const size_t block = g.size() / 4;
    for (size_t e = 0; e < 4; ++e) {
      const std::vector<double> part(g.begin() + static_cast<std::ptrdiff_t>(e * block),
                                     g.begin() + static_cast<std::ptrdiff_t>((e + 1) * block));
      if (static_cast<int64_t>(e) < cs.k) {
        EXPECT_GT(max_abs(part), 1e-6) << "expert " << e;
      } else {
        EXPECT_EQ(max_abs(part), 0.0) << "expert " << e;
      }
    }
    expect_input_gradients(b, tokens, 2);
  }
}

// ---- activation recomputation ----------------------------------------------------------

// --recompute-modules moe_act: the forward keeps no activation output; the backward rebuilds it
// from fc1's output, so the input and every parameter gradient equal the plain layer's bit for bit
// (SwiGLU and GELU).
TEST(MoeLayer, RecomputedActivationGivesTheSameGradients) {
  for (bool swiglu : {true, false}) {
    std::vector<std::vector<double>> result[2];
    const Tensor x = random_tensor({12, kHidden}, DType::F64), dy = random_tensor({12, kHidden}, DType::F64);
    for (int recompute = 0; recompute < 2; ++recompute) {
      ModelConfig c = moe_config(4, 2);
      c.swiglu = swiglu;
      c.moe.aux_loss_coeff = 0.1;
      c.moe.recompute_act = recompute == 1;
      Built b = build(c);
      MoeLayer::Ctx ctx;
      const Tensor y = b.layer->forward(x, 2, true, 3, ctx);
      EXPECT_EQ(ctx.experts.act.defined(), recompute == 0) << "the activation output is kept only without recomputation";
      result[recompute].push_back(y.to_vector<double>());
      result[recompute].push_back(b.layer->backward(dy, 1.0, ctx).to_vector<double>());
      for (const char* p : {"experts.linear_fc1.weight", "experts.linear_fc2.weight", "router.weight"})
        result[recompute].push_back(b.grad(p));
    }
    ASSERT_EQ(result[0].size(), result[1].size());
    for (size_t i = 0; i < result[0].size(); ++i) EXPECT_EQ(result[0][i], result[1][i]) << "tensor " << i;
  }
}
