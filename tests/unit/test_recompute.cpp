// Activation recomputation over the whole model (cfg.recompute): --recompute-modules moe, mlp, core_attn,
// shared_experts,
// --recompute-granularity full with --recompute-method uniform and block. Each gives the same
// losses, balancing-loss statistics and parameter gradients, bit for bit, as keeping everything,
// over two accumulated micro-batches (global_aux_loss's counts would show a routing counted
// twice), with input jitter and a shared expert; the saved tensors are really dropped, and full
// recomputation lowers the forward's peak of allocated CPU memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "moecore/core/allocator.h"
#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"

using namespace moecore;

namespace {

ModelConfig recompute_model() {
  ModelConfig c;
  c.num_layers = 4;
  c.hidden_size = 16;
  c.ffn_hidden_size = 24;
  c.num_attention_heads = 2;
  c.seq_length = 8;
  c.vocab_size = 13;
  c.add_bias_linear = false;
  c.init_method_std = 0.3;
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 6;
  c.moe.shared_expert_size = 10;
  c.moe.input_jitter_eps = 0.1;
  c.moe.load_balancing = LoadBalancing::GlobalAuxLoss;
  c.moe.aux_loss_coeff = 0.1;
  c.moe.z_loss_coeff = 0.01;
  finalize_model_config(c, "[0,1,1,1]");  // a dense first layer, then MoE layers
  return c;
}

struct StepRun {
  std::vector<double> losses, aux, z, tokens_per_expert;
  std::vector<std::vector<double>> grads;
  int64_t forward_peak = 0;  // the largest allocated bytes during a forward, above before it
};

// Two micro-batches, each forward then backward (grad scale 1/2), one step's statistics.
StepRun train_step(const RecomputeConfig& recompute, const std::function<void(const GPTModel::Ctx&)>& inspect = {}) {
  ModelConfig c = recompute_model();
  c.recompute = recompute;
  ParamStore store(Device::cpu(), DType::F64, DType::F64, 42);
  GPTModel model(c, store);
  store.initialize();
  const MockData data(c.vocab_size, c.seq_length, 5, "train");
  StepRun run;
  for (int64_t m = 0; m < 2; ++m) {
    const Batch b = data.batch(m * 4, 4, Device::cpu());
    GPTModel::Ctx ctx;
    const int64_t before = cpu_allocator().stats().allocated_bytes;
    cpu_allocator().reset_peak();
    run.losses.push_back(model.forward(b.tokens, b.labels, true, 11 + static_cast<uint64_t>(m), ctx));
    run.forward_peak = std::max(run.forward_peak, cpu_allocator().stats().peak_allocated_bytes - before);
    if (inspect) inspect(ctx);
    model.backward(0.5, ctx);
  }
  for (MoeLayer* l : model.moe_layers()) {
    const MoeStepStats s = l->finish_step();
    run.aux.push_back(s.aux_loss);
    run.z.push_back(s.z_loss);
    run.tokens_per_expert.insert(run.tokens_per_expert.end(), s.tokens_per_expert.begin(), s.tokens_per_expert.end());
  }
  for (const auto& p : store.all())
    if (p->trainable) run.grads.push_back(p->grad.to_vector<double>());
  return run;
}

void expect_identical(const StepRun& a, const StepRun& b, const std::string& what) {
  EXPECT_EQ(a.losses, b.losses) << what;
  EXPECT_EQ(a.aux, b.aux) << what;
  EXPECT_EQ(a.z, b.z) << what;
  EXPECT_EQ(a.tokens_per_expert, b.tokens_per_expert) << what;
  EXPECT_FALSE(a.tokens_per_expert.empty());
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << what << ": parameter " << i;
}

RecomputeConfig full(const std::string& method, int64_t layers) {
  RecomputeConfig r;
  r.full_method = method;
  r.full_num_layers = layers;
  return r;
}

}  // namespace

TEST(Recompute, SelectiveMoeAndMlpChangeNothing) {
  const StepRun plain = train_step({});
  RecomputeConfig moe, mlp, both;
  moe.moe = true;
  mlp.mlp = true;
  both.moe = both.mlp = true;
  expect_identical(plain, train_step(moe, [](const GPTModel::Ctx& ctx) {
    EXPECT_TRUE(ctx.layers[1].moe_dropped);
    EXPECT_TRUE(ctx.layers[1].moe.x.defined());  // the input is kept
    EXPECT_FALSE(ctx.layers[1].moe.experts.fc1_out.defined());
    EXPECT_TRUE(ctx.layers[0].mlp.fc1_out.defined());
  }), "moe");
  expect_identical(plain, train_step(mlp, [](const GPTModel::Ctx& ctx) {
    EXPECT_TRUE(ctx.layers[0].mlp_input.defined());
    EXPECT_FALSE(ctx.layers[0].mlp.fc1_out.defined());
  }), "mlp");
  expect_identical(plain, train_step(both), "moe + mlp");
  RecomputeConfig core;
  core.core_attn = true;
  expect_identical(plain, train_step(core, [](const GPTModel::Ctx& ctx) {
    EXPECT_TRUE(ctx.layers[1].attn.core_q.defined());
    EXPECT_FALSE(ctx.layers[1].attn.core_out.defined());
    EXPECT_FALSE(ctx.layers[1].attn.o.x.defined());
  }), "core_attn");
  RecomputeConfig shared;
  shared.shared_experts = true;
  expect_identical(plain, train_step(shared, [](const GPTModel::Ctx& ctx) {
    EXPECT_TRUE(ctx.layers[2].moe.shared_dropped);
    EXPECT_FALSE(ctx.layers[2].moe.shared.out.defined());
    EXPECT_TRUE(ctx.layers[2].moe.experts.fc1_out.defined());
  }), "shared_experts");
  shared.moe = true;  // moe rebuilds the shared experts with the rest
  expect_identical(plain, train_step(shared), "shared_experts + moe");
}

TEST(Recompute, FullUniformAndBlockChangeNothing) {
  const StepRun plain = train_step({});
  for (int64_t n : {1, 3, 4}) {
    expect_identical(plain, train_step(full("uniform", n), [n](const GPTModel::Ctx& ctx) {
      for (int64_t i = 0; i < 4; ++i) {
        const auto& lc = ctx.layers[static_cast<size_t>(i)];
        EXPECT_EQ(lc.recompute_first, i / n * n) << "layer " << i;
        EXPECT_EQ(lc.recompute_input.defined(), i % n == 0) << "layer " << i;
        EXPECT_FALSE(lc.attn_norm.x.defined()) << "layer " << i;
      }
    }), "uniform " + std::to_string(n));
  }
  for (int64_t n : {1, 2, 4}) {
    expect_identical(plain, train_step(full("block", n), [n](const GPTModel::Ctx& ctx) {
      for (int64_t i = 0; i < 4; ++i) {
        const auto& lc = ctx.layers[static_cast<size_t>(i)];
        EXPECT_EQ(lc.recompute_first, i < n ? i : -1) << "layer " << i;
        EXPECT_EQ(lc.attn_norm.x.defined(), i >= n) << "layer " << i;
      }
    }), "block " + std::to_string(n));
  }
  RecomputeConfig with_modules = full("block", 2);
  with_modules.moe = with_modules.mlp = with_modules.core_attn = with_modules.shared_experts = true;
  expect_identical(plain, train_step(with_modules), "block 2 with moe, mlp, core_attn and shared_experts");
}

TEST(Recompute, FullRecomputationLowersTheForwardPeak) {
  const StepRun plain = train_step({});
  const StepRun uniform = train_step(full("uniform", 1));
  const StepRun block = train_step(full("block", 2));
  RecomputeConfig moe;
  moe.moe = true;
  const StepRun moe_only = train_step(moe);
  EXPECT_LT(uniform.forward_peak, block.forward_peak);
  EXPECT_LT(block.forward_peak, plain.forward_peak);
  EXPECT_LT(moe_only.forward_peak, plain.forward_peak);
}

// A pipeline stage holding layers [1, 4): block counts its first layers from the stage's start.
TEST(Recompute, BlockCountsFromTheStagesFirstLayer) {
  ModelConfig c = recompute_model();
  c.recompute = full("block", 1);
  ParamStore store(Device::cpu(), DType::F64, DType::F64, 42);
  PipelineStage stage;
  stage.first_layer = 1;
  stage.end_layer = 4;
  stage.has_embedding = false;
  GPTModel model(c, store, {}, stage);
  store.initialize();
  const MockData data(c.vocab_size, c.seq_length, 5, "train");
  const Batch b = data.batch(0, 2, Device::cpu());
  Tensor hidden = Tensor::zeros({2 * c.seq_length, c.hidden_size}, DType::F64, Device::cpu());
  GPTModel::Ctx ctx;
  model.forward(b.tokens, b.labels, true, 3, ctx, hidden);
  EXPECT_EQ(ctx.layers[1].recompute_first, 1);
  EXPECT_EQ(ctx.layers[2].recompute_first, -1);
  EXPECT_EQ(ctx.layers[3].recompute_first, -1);
}
