// Gradients left stale by the optimizer step (ParamStore::mark_grads_stale) instead of zeroed:
// the next backward must give exactly the gradients of a backward into zeroed buffers, whatever
// the stale buffers hold. Every gradient producer (GEMM wgrads with beta 0, grouped expert
// wgrads that overwrite, norms, biases, embeddings, the router) goes through Param's
// grad_accumulates() / grad_to_accumulate(); one that wrote p.grad directly would add to the
// NaN below (or scale it by beta 0 instead of ignoring it) and fail here.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"
#include "moecore/ops/elementwise.h"

using namespace moecore;

namespace {

ModelConfig base_config() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.ffn_hidden_size = 12;
  c.num_attention_heads = 2;
  c.seq_length = 6;
  c.vocab_size = 11;
  c.init_method_std = 0.3;
  return c;
}

// Two micro-batches (the first writes, the second adds) into stale buffers full of `garbage`,
// against the same into zeroed buffers.
void check_stale_equals_zeroed(ModelConfig cfg, DType master, const std::string& moe_layer_freq = "1") {
  finalize_model_config(cfg, moe_layer_freq);
  ParamStore zeroed(Device::cpu(), master, master, 42), stale(Device::cpu(), master, master, 42);
  GPTModel model_zeroed(cfg, zeroed), model_stale(cfg, stale);
  zeroed.initialize();
  stale.initialize();
  for (const auto& p : stale.all())
    if (p->trainable) ops::fill(p->grad, std::numeric_limits<double>::quiet_NaN());  // garbage: NaN poisons 0 * old too
  stale.mark_grads_stale();
  const MockData data(cfg.vocab_size, cfg.seq_length, 3, "train");
  for (int64_t m = 0; m < 2; ++m) {
    const Batch b = data.batch(2 * m, 2, Device::cpu());
    for (GPTModel* model : {&model_zeroed, &model_stale}) {
      GPTModel::Ctx ctx;
      model->forward(b.tokens, b.labels, true, 7 + static_cast<uint64_t>(m), ctx);
      model->backward(0.5, ctx);
    }
  }
  stale.zero_stale_grads();
  int compared = 0;
  for (size_t i = 0; i < zeroed.all().size(); ++i) {
    const Param& z = *zeroed.all()[i];
    const Param& s = *stale.all()[i];
    if (!z.trainable) continue;
    EXPECT_FALSE(s.grad_stale) << s.name;
    const Tensor zg = z.grad.to(Device::cpu()), sg = s.grad.to(Device::cpu());
    const std::vector<double> a = ops::cast_to(zg, DType::F64).to_vector<double>();
    const std::vector<double> b = ops::cast_to(sg, DType::F64).to_vector<double>();
    ASSERT_EQ(a.size(), b.size()) << s.name;
    double worst = 0;
    for (size_t k = 0; k < a.size(); ++k) worst = std::max(worst, std::fabs(a[k] - b[k]));
    EXPECT_EQ(worst, 0.0) << s.name << ": the stale-buffer backward differs from the zeroed one";
    ++compared;
  }
  EXPECT_GT(compared, 10);
}

}  // namespace

TEST(StaleGradients, DenseLayernormGeluBiasesLearnedPositionsTied) {
  ModelConfig c = base_config();
  c.rmsnorm = false;
  c.swiglu = false;
  c.add_bias_linear = true;
  c.position_embedding_type = "learned_absolute";
  check_stale_equals_zeroed(c, DType::F64);
}

TEST(StaleGradients, MoeGatedSharedExpertQkvBiasZLossUntied) {
  ModelConfig c = base_config();
  c.add_bias_linear = false;
  c.add_qkv_bias = true;
  c.swiglu = true;
  c.untie_embeddings = true;
  c.qk_layernorm = true;
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 6;
  c.moe.aux_loss_coeff = 0.1;
  c.moe.z_loss_coeff = 0.05;
  c.moe.shared_expert_size = 5;
  c.moe.shared_expert_gate = true;
  check_stale_equals_zeroed(c, DType::F64, "[1,0]");  // one MoE layer, one dense
}

// 16 experts, top-1, 12 tokens a micro-batch: some experts get no rows (their wgrad slices are
// zeroed when overwriting); an fp64 router on f32 master weights (its add path).
TEST(StaleGradients, MoeEmptyExpertsFp64RouterOnF32Masters) {
  ModelConfig c = base_config();
  c.swiglu = true;
  c.add_bias_linear = false;
  c.moe.num_experts = 16;
  c.moe.router.topk = 1;
  c.moe.ffn_hidden_size = 6;
  c.moe.aux_loss_coeff = 0.1;
  c.moe.router_fp64 = true;
  check_stale_equals_zeroed(c, DType::F32);
}

// Capacity dropping with padding (every expert has its capacity's rows).
TEST(StaleGradients, MoeCapacityPadding) {
  ModelConfig c = base_config();
  c.swiglu = true;
  c.add_bias_linear = false;
  c.moe.num_experts = 8;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 6;
  c.moe.aux_loss_coeff = 0.1;
  c.moe.capacity_factor = 0.5;
  c.moe.pad_to_capacity = true;
  check_stale_equals_zeroed(c, DType::F64);
}

TEST(StaleGradients, StoreMarksOverwritesAndZeroesRanges) {
  ParamStore store(Device::cpu(), DType::F32, DType::F32, 1);
  Param& a = store.add("a.weight", {4}, Init::Ones, 0.0, true);
  Param& b = store.add("b.weight", {100}, Init::Ones, 0.0, true);
  store.initialize();
  ops::fill(a.grad, 3.0);
  ops::fill(b.grad, 3.0);
  store.mark_grads_stale();
  EXPECT_TRUE(a.grad_stale);
  EXPECT_EQ(a.grad_beta(), 0.0f);  // the first write overwrites...
  EXPECT_EQ(a.grad_beta(), 1.0f);  // ...the next ones add
  EXPECT_EQ(a.grad.to_vector<float>()[0], 3.0f);  // overwriting is the producer's job
  // Only gradients overlapping the range are zeroed: a is current, b starts at 64 (alignment).
  store.zero_stale_grads(false, 0, 64);
  EXPECT_TRUE(b.grad_stale);
  EXPECT_EQ(b.grad.to_vector<float>()[0], 3.0f);
  store.zero_stale_grads(false, 64, 65);
  EXPECT_FALSE(b.grad_stale);
  EXPECT_EQ(b.grad.to_vector<float>()[99], 0.0f);
  store.mark_grads_stale();
  EXPECT_EQ(b.grad_to_accumulate().to_vector<float>()[5], 0.0f);  // zeroed before adding
  EXPECT_FALSE(b.grad_stale);
  store.zero_grad();
  EXPECT_FALSE(a.grad_stale);
}
