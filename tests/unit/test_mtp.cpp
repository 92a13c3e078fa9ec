// Multi-token prediction (model/mtp.h): the shifted inputs, the f64 finite-difference check of
// every parameter's gradient with the MTP loss in the objective (dense and MoE, one and two
// depths, tied and untied output layer, the fused and the plain output layer), the main loss
// unchanged by the modules, evaluation without them, and the parameter count.
#include <gtest/gtest.h>

#include <cmath>

#include "moecore/core/philox.h"
#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"
#include "moecore/model/param_count.h"
#include "op_harness.h"

using namespace moecore;

namespace {

ModelConfig mtp_config(int64_t depths) {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.ffn_hidden_size = 12;
  c.num_attention_heads = 2;
  c.seq_length = 6;
  c.vocab_size = 11;
  c.add_bias_linear = false;
  c.init_method_std = 0.3;
  c.mtp_num_layers = depths;
  c.mtp_loss_scaling_factor = 0.7;  // large enough that the MTP gradients are visible
  return c;
}

ModelConfig mtp_moe_config(int64_t depths) {
  ModelConfig c = mtp_config(depths);
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 6;
  c.moe.aux_loss_coeff = 0.1;
  return c;
}

// lm loss + scale / D * sum_k mtp loss_k + the MoE balancing losses.
double objective(GPTModel& model, const Batch& b, GPTModel::Ctx& ctx, bool fused, bool keep) {
  for (MoeLayer* l : model.moe_layers()) l->finish_step();
  if (fused) ctx.fused_head_scale = 1.0;
  const double lm = model.forward(b.tokens, b.labels, true, 7, ctx);
  const ModelConfig& cfg = model.config();
  double mtp = 0;
  EXPECT_EQ(static_cast<int64_t>(ctx.mtp_loss_sums.size()), cfg.mtp_num_layers);
  for (size_t k = 0; k < ctx.mtp_loss_sums.size(); ++k)
    mtp += ctx.mtp_loss_sums[k].to_vector<double>()[0] / static_cast<double>(ctx.mtp_num_labels[k]);
  double extra = 0;
  for (MoeLayer* l : model.moe_layers()) extra += l->stats().aux_loss * cfg.moe.aux_loss_coeff;
  if (!keep) ctx = GPTModel::Ctx{};
  return lm + cfg.mtp_loss_scaling_factor / static_cast<double>(cfg.mtp_num_layers) * mtp + extra;
}

void check_mtp_gradients(ModelConfig cfg, bool fused) {
  finalize_model_config(cfg, "1");
  ParamStore store(Device::cpu(), DType::F64, DType::F64, 42);
  GPTModel model(cfg, store);
  store.initialize();
  const MockData data(cfg.vocab_size, cfg.seq_length, 3, "train");
  const Batch b = data.batch(0, 2, Device::cpu());
  GPTModel::Ctx ctx;
  objective(model, b, ctx, fused, true);
  model.backward(1.0, ctx);
  // The gradients now: with the fused output layer every forward below adds to the output layer's.
  std::vector<std::vector<double>> grads;
  for (const auto& p : store.all()) grads.push_back(p->trainable ? p->grad.to_vector<double>() : std::vector<double>());
  int checked = 0, mtp_checked = 0;
  size_t index = 0;
  for (const auto& p : store.all()) {
    const std::vector<double>& grad = grads[index++];
    if (!p->trainable) continue;
    const int64_t n = p->master.numel();
    for (int s = 0; s < 3; ++s) {
      const int64_t i = static_cast<int64_t>(philox_words(5, rng_key(p->name), static_cast<uint64_t>(s)).w[0] % n);
      double* w = p->master.data<double>() + i;
      const double orig = *w, h = 1e-6;
      GPTModel::Ctx c;
      *w = orig + h;
      const double up = objective(model, b, c, fused, false);
      *w = orig - h;
      const double down = objective(model, b, c, fused, false);
      *w = orig;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(grad[static_cast<size_t>(i)], numeric, 1e-6 + 1e-4 * std::fabs(numeric)) << p->name << "[" << i << "]";
      ++checked;
      mtp_checked += p->name.rfind("mtp.", 0) == 0 ? 1 : 0;
    }
  }
  EXPECT_GT(mtp_checked, 3 * 6 * cfg.mtp_num_layers);  // enorm, hnorm, eh_proj, the layer's, final_layernorm
  EXPECT_GT(checked, mtp_checked);
}

}  // namespace

TEST(Mtp, ShiftedInputs) {
  const Tensor tokens = Tensor::from_vector<int32_t>({1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
  const Tensor labels = Tensor::from_vector<int32_t>({2, 3, -1, 9, 6, 7, 8, 3}, {2, 4});
  const MtpBatch m = make_mtp_batch(tokens, labels, 2);
  ASSERT_EQ(m.tokens.size(), 2u);
  EXPECT_EQ(m.tokens[0].to_vector<int32_t>(), (std::vector<int32_t>{2, 3, 4, 0, 6, 7, 8, 0}));
  EXPECT_EQ(m.labels[0].to_vector<int32_t>(), (std::vector<int32_t>{3, -1, 9, -1, 7, 8, 3, -1}));
  EXPECT_EQ(m.tokens[1].to_vector<int32_t>(), (std::vector<int32_t>{3, 4, 0, 0, 7, 8, 0, 0}));
  EXPECT_EQ(m.labels[1].to_vector<int32_t>(), (std::vector<int32_t>{-1, 9, -1, -1, 8, 3, -1, -1}));
  EXPECT_EQ(m.num_labels, (std::vector<int64_t>{5, 3}));
}

TEST(Mtp, GradientsDenseOneDepthPlainHead) { check_mtp_gradients(mtp_config(1), false); }

TEST(Mtp, GradientsDenseTwoDepthsUntiedFusedHead) {
  ModelConfig c = mtp_config(2);
  c.untie_embeddings = true;
  check_mtp_gradients(c, true);
}

TEST(Mtp, GradientsMoeOneDepthFusedHead) { check_mtp_gradients(mtp_moe_config(1), true); }

TEST(Mtp, GradientsMoeTwoDepthsSigmoidSharedExpertPlainHead) {
  ModelConfig c = mtp_moe_config(2);
  c.moe.router.score = ops::RouterScore::Sigmoid;
  c.moe.shared_expert_size = 5;
  c.untie_embeddings = true;
  check_mtp_gradients(c, false);
}

// The modules add their own parameters only (names key the initialisation): the main loss and
// its gradients of the main model's parameters are the model's without MTP; evaluation runs no
// MTP.
TEST(Mtp, MainLossUnchangedAndEvaluationWithoutMtp) {
  ModelConfig with = mtp_config(2), without = mtp_config(0);
  finalize_model_config(with, "1");
  finalize_model_config(without, "1");
  ParamStore s1(Device::cpu(), DType::F64, DType::F64, 3), s0(Device::cpu(), DType::F64, DType::F64, 3);
  GPTModel m1(with, s1), m0(without, s0);
  s1.initialize();
  s0.initialize();
  const MockData data(with.vocab_size, with.seq_length, 3, "train");
  const Batch b = data.batch(0, 2, Device::cpu());
  GPTModel::Ctx c1, c0;
  EXPECT_EQ(m1.forward(b.tokens, b.labels, true, 7, c1), m0.forward(b.tokens, b.labels, true, 7, c0));
  EXPECT_EQ(c1.mtp_loss_sums.size(), 2u);
  EXPECT_TRUE(c0.mtp_loss_sums.empty());
  GPTModel::Ctx e;
  EXPECT_EQ(m1.forward(b.tokens, b.labels, false, 7, e), m0.forward(b.tokens, b.labels, false, 7, c0 = {}));
  EXPECT_TRUE(e.mtp_loss_sums.empty());
  EXPECT_GT(s1.all().size(), s0.all().size());
}

TEST(Mtp, ParamCountIncludesTheModules) {
  ModelConfig with = mtp_moe_config(2), without = mtp_moe_config(0);
  finalize_model_config(with, "1");
  finalize_model_config(without, "1");
  const ParamCount a = count_parameters(with), b = count_parameters(without);
  const int64_t h = with.hidden_size, e = with.moe.num_experts, f = with.moe.ffn_hidden_size, k = with.moe.router.topk;
  // Per module: enorm, hnorm, final_layernorm, eh_proj [H, 2H], the layer (two norms, q/k/v/o,
  // router, experts [E, 2F, H] + [E, H, F]).
  const int64_t attention = 4 * h * h, experts = e * 3 * f * h;
  const int64_t module = 3 * h + 2 * h * h + 2 * h + attention + e * h + experts;
  EXPECT_EQ(a.part("mtp"), 2 * module);
  EXPECT_EQ(a.total - b.total, 2 * module);
  EXPECT_EQ(a.mtp_active, 2 * (module - experts + experts / e * k));
  EXPECT_EQ(a.active - b.active, a.mtp_active);
  EXPECT_EQ(b.part("mtp"), 0);
}
