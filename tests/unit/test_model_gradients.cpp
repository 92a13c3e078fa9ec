// Whole-model gradient checks: a tiny GPT in f64 on the CPU, every parameter's analytic
// gradient (from the explicit backward passes) against central finite differences of the
// objective = LM loss + the MoE balancing losses, over the model and router options.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "moecore/core/philox.h"
#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"
#include "moecore/ops/random.h"
#include "op_harness.h"

using namespace moecore;

namespace {

ModelConfig tiny_config() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 8;
  c.ffn_hidden_size = 12;
  c.num_attention_heads = 2;
  c.seq_length = 5;
  c.vocab_size = 11;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.init_method_std = 0.3;  // large enough that every path has visible gradients
  return c;
}

ModelConfig moe_config() {
  ModelConfig c = tiny_config();
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 6;
  c.moe.aux_loss_coeff = 0.1;
  return c;
}

double objective(GPTModel& model, const Batch& b, GPTModel::Ctx& ctx, bool keep) {
  for (MoeLayer* l : model.moe_layers()) l->finish_step();
  const double lm = model.forward(b.tokens, b.labels, true, 7, ctx);
  double extra = 0;
  for (MoeLayer* l : model.moe_layers())
    extra += l->stats().aux_loss * model.config().moe.aux_loss_coeff + l->stats().z_loss * model.config().moe.z_loss_coeff;
  if (!keep) ctx = GPTModel::Ctx{};
  return lm + extra;
}

void check_model_gradients(ModelConfig cfg, const std::string& moe_layer_freq = "1") {
  finalize_model_config(cfg, moe_layer_freq);
  ParamStore store(Device::cpu(), DType::F64, DType::F64, 42);
  GPTModel model(cfg, store);
  store.initialize();
  // A nonzero expert bias, so that it shapes the selection (its updates are off in these tests:
  // objective() ends a step before every evaluation).
  for (const auto& p : store.all())
    if (!p->trainable) ops::fill_uniform(p->master, 9, rng_key(p->name), -0.3, 0.3);
  const MockData data(cfg.vocab_size, cfg.seq_length, 3, "train");
  const Batch b = data.batch(0, 2, Device::cpu());
  GPTModel::Ctx ctx;
  objective(model, b, ctx, true);
  model.backward(1.0, ctx);
  int checked = 0;
  for (const auto& p : store.all()) {
    if (!p->trainable) continue;
    const std::vector<double> grad = p->grad.to_vector<double>();
    const int64_t n = p->master.numel();
    for (int s = 0; s < 3; ++s) {
      const int64_t i = static_cast<int64_t>(philox_words(5, rng_key(p->name), static_cast<uint64_t>(s)).w[0] % n);
      double* w = p->master.data<double>() + i;
      const double orig = *w, h = 1e-6;
      GPTModel::Ctx c;
      *w = orig + h;
      const double up = objective(model, b, c, false);
      *w = orig - h;
      const double down = objective(model, b, c, false);
      *w = orig;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(grad[static_cast<size_t>(i)], numeric, 1e-6 + 1e-4 * std::fabs(numeric))
          << p->name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 20);
}

}  // namespace

TEST(ModelGradients, DenseRmsnormSwigluRope) { check_model_gradients(tiny_config()); }

TEST(ModelGradients, DenseLayernormGeluBiasLearnedPositionsUntied) {
  ModelConfig c = tiny_config();
  c.rmsnorm = false;
  c.swiglu = false;
  c.add_bias_linear = true;
  c.position_embedding_type = "learned_absolute";
  c.untie_embeddings = true;
  check_model_gradients(c);
}

TEST(ModelGradients, GqaWithQkLayernorm) {
  ModelConfig c = tiny_config();
  c.num_attention_heads = 4;
  c.kv_channels = 2;
  c.num_query_groups = 2;
  c.qk_layernorm = true;
  check_model_gradients(c);
}

// --add-qkv-bias (Qwen2): biases on linear_q/k/v only, with --disable-bias-linear, GQA, and the
// Qwen2-MoE layer shape (pre-softmax routing, gated shared expert).
TEST(ModelGradients, QkvBiasGqaPreSoftmaxGatedSharedExpert) {
  ModelConfig c = moe_config();
  c.add_bias_linear = false;
  c.add_qkv_bias = true;
  c.num_attention_heads = 4;
  c.kv_channels = 2;
  c.num_query_groups = 2;
  c.moe.router.pre_softmax = true;
  c.moe.shared_expert_size = 5;
  c.moe.shared_expert_gate = true;
  {  // the biases exist on q/k/v and nowhere else
    ModelConfig f = c;
    finalize_model_config(f, "[0,1]");
    ParamStore store(Device::cpu(), DType::F64, DType::F64, 1);
    GPTModel model(f, store);
    int biases = 0;
    for (const auto& p : store.all()) biases += p->name.ends_with(".bias") ? 1 : 0;
    EXPECT_EQ(biases, 6);  // 2 layers x linear_q/k/v
    EXPECT_EQ(store.get("decoder.layers.1.self_attention.linear_k.bias").shape, (Shape{4}));
  }
  check_model_gradients(c, "[0,1]");
}

// Multi-Latent Attention (model/mla_attention.h): q-lora with both latent RMSNorms and YaRN
// (factor 4; base 3, original context 11 and betas 2 / 1 put the ramp at dims 0..2 of the 3 RoPE
// pairs, so that extrapolated, blended and interpolated frequencies and the mscale of the cos/sin
// and of the softmax scale all act), sigmoid group-limited routing with a shared expert.
ModelConfig mla_config() {
  ModelConfig c = moe_config();
  c.mla.enabled = true;
  c.mla.q_lora_rank = 5;
  c.mla.kv_lora_rank = 4;
  c.mla.qk_head_dim = 3;
  c.mla.qk_pos_emb_head_dim = 6;
  c.mla.v_head_dim = 2;
  c.qk_layernorm = true;
  c.rope_yarn = true;
  c.rope_scaling.factor = 4;
  c.rope_scaling.original_max_position = 11;
  c.rope_scaling.beta_fast = 2;
  c.rope_scaling.beta_slow = 1;
  c.rope_scaling.mscale = 0.8;
  c.rope_scaling.mscale_all_dim = 0.5;
  c.rotary_base = 3;
  return c;
}

TEST(ModelGradients, MlaQLoraLatentNormsYarnSigmoidSharedExpert) {
  ModelConfig c = mla_config();
  c.moe.router.score = ops::RouterScore::Sigmoid;
  c.moe.router.num_groups = 2;
  c.moe.router.group_topk = 1;
  c.moe.shared_expert_size = 5;
  check_model_gradients(c, "[0,1]");
}

// DeepSeek-V2-Lite's form: a plain query projection (--q-lora-rank 0), no latent norms; with
// biases (so a dense model: experts have none), LayerNorm, plain RoPE.
TEST(ModelGradients, MlaPlainQueryProjectionBiasesLayernormRope) {
  ModelConfig c = mla_config();
  c.moe = MoeConfig{};
  c.mla.q_lora_rank = 0;
  c.qk_layernorm = false;
  c.add_bias_linear = true;
  c.rmsnorm = false;
  c.rope_yarn = false;
  c.rope_scaling = {};
  check_model_gradients(c);
}

// --recompute-modules mla_up_proj: the same loss and bit-identical gradients, with q, k and v
// not kept after the forward.
TEST(ModelGradients, MlaUpProjectionRecomputationChangesNothing) {
  std::vector<std::vector<double>> grads[2];
  double losses[2];
  for (int recompute = 0; recompute < 2; ++recompute) {
    ModelConfig c = mla_config();
    c.mla.recompute_up_proj = recompute == 1;
    finalize_model_config(c, "1");
    ParamStore store(Device::cpu(), DType::F64, DType::F64, 42);
    GPTModel model(c, store);
    store.initialize();
    const MockData data(c.vocab_size, c.seq_length, 3, "train");
    const Batch b = data.batch(0, 2, Device::cpu());
    GPTModel::Ctx ctx;
    losses[recompute] = model.forward(b.tokens, b.labels, true, 7, ctx);
    EXPECT_EQ(ctx.layers[0].mla.core.q.defined(), recompute == 0);
    EXPECT_EQ(ctx.layers[0].mla.core.v.defined(), recompute == 0);
    model.backward(1.0, ctx);
    for (const auto& p : store.all())
      if (p->trainable) grads[recompute].push_back(p->grad.to_vector<double>());
  }
  EXPECT_EQ(losses[0], losses[1]);
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_EQ(grads[0][i], grads[1][i]) << "parameter " << i;
}

// The MLA parameters under Megatron-Core's names and shapes.
TEST(ModelGradients, MlaParameterNamesAndShapes) {
  for (int64_t q_lora : {int64_t{0}, int64_t{5}}) {
    ModelConfig c = mla_config();
    c.mla.q_lora_rank = q_lora;
    finalize_model_config(c, "1");
    ParamStore store(Device::cpu(), DType::F64, DType::F64, 1);
    GPTModel model(c, store);
    const std::string a = "decoder.layers.1.self_attention.";
    const int64_t n = c.num_attention_heads, h = c.hidden_size;
    if (q_lora > 0) {
      EXPECT_EQ(store.get(a + "linear_q_down_proj.weight").shape, (Shape{5, h}));
      EXPECT_EQ(store.get(a + "q_layernorm.weight").shape, (Shape{5}));
      EXPECT_EQ(store.get(a + "linear_q_up_proj.weight").shape, (Shape{n * 9, 5}));
    } else {
      EXPECT_EQ(store.get(a + "linear_q_proj.weight").shape, (Shape{n * 9, h}));
    }
    EXPECT_EQ(store.get(a + "linear_kv_down_proj.weight").shape, (Shape{4 + 6, h}));
    EXPECT_EQ(store.get(a + "kv_layernorm.weight").shape, (Shape{4}));
    EXPECT_EQ(store.get(a + "linear_kv_up_proj.weight").shape, (Shape{n * (3 + 2), 4}));
    EXPECT_EQ(store.get(a + "linear_proj.weight").shape, (Shape{h, n * 2}));
  }
}

TEST(ModelGradients, MoeSoftmaxAuxLossAndZLoss) {
  ModelConfig c = moe_config();
  c.moe.z_loss_coeff = 0.05;
  check_model_gradients(c);
}

TEST(ModelGradients, MoePreSoftmaxSeqAuxLossScaling) {
  ModelConfig c = moe_config();
  c.moe.router.pre_softmax = true;
  c.moe.router.scaling_factor = 2.5;
  c.moe.load_balancing = LoadBalancing::SeqAuxLoss;
  check_model_gradients(c);
}

TEST(ModelGradients, MoeSigmoidGroupLimitedExpertBiasGlobalAux) {
  ModelConfig c = moe_config();
  c.moe.router.score = ops::RouterScore::Sigmoid;
  c.moe.router.num_groups = 2;
  c.moe.router.group_topk = 1;
  c.moe.enable_expert_bias = true;
  c.moe.bias_update_rate = 0.0;
  c.moe.load_balancing = LoadBalancing::GlobalAuxLoss;
  check_model_gradients(c);
}

TEST(ModelGradients, MoeCapacityDropPaddingAndGatedSharedExpert) {
  ModelConfig c = moe_config();
  c.moe.capacity_factor = 0.75;
  c.moe.pad_to_capacity = true;
  c.moe.drop_policy = ops::DropPolicy::Position;
  c.moe.shared_expert_size = 5;
  c.moe.shared_expert_gate = true;
  c.moe.input_jitter_eps = 0.01;
  check_model_gradients(c, "[0,1]");
}

TEST(ModelGradients, MoeSinkhornGelu) {
  ModelConfig c = moe_config();
  c.swiglu = false;
  c.moe.load_balancing = LoadBalancing::Sinkhorn;
  c.moe.aux_loss_coeff = 0.0;
  check_model_gradients(c);
}

// The fused output layer (the loss and its backward computed chunk by chunk in the forward, no
// [T, V] logits kept) gives the plain path's loss and every gradient, tied or untied, with
// ignored labels and chunks that do not divide the tokens; evaluation's chunked loss equals the
// plain one; a different grad_scale in backward() than the one given before the forward is refused.
TEST(ModelGradients, FusedOutputLayerEqualsThePlainOne) {
  for (bool untie : {false, true}) {
    ModelConfig cfg = moe_config();
    cfg.untie_embeddings = untie;
    finalize_model_config(cfg, "1");
    const MockData data(cfg.vocab_size, cfg.seq_length, 3, "train");
    Batch b = data.batch(0, 2, Device::cpu());
    b.labels.data<int32_t>()[3] = -1;  // an ignored token
    std::vector<std::vector<double>> grads[2];
    double loss[2] = {0, 0};
    for (int fused = 0; fused < 2; ++fused) {
      ParamStore store(Device::cpu(), DType::F64, DType::F64, 42);
      GPTModel model(cfg, store);
      store.initialize();
      model.set_head_chunk_rows(3);  // 10 tokens: chunks of 3, 3, 3, 1
      GPTModel::Ctx ctx;
      if (fused) ctx.fused_head_scale = 0.5;
      loss[fused] = model.forward(b.tokens, b.labels, true, 7, ctx);
      EXPECT_EQ(ctx.logits.defined(), !fused) << "the fused path keeps no logits";
      model.backward(0.5, ctx);
      for (const auto& p : store.all())
        if (p->trainable) grads[fused].push_back(p->grad.to_vector<double>());
    }
    EXPECT_NEAR(loss[1], loss[0], 1e-13 * std::fabs(loss[0]));
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (size_t i = 0; i < grads[0].size(); ++i)
      for (size_t j = 0; j < grads[0][i].size(); ++j)
        ASSERT_NEAR(grads[1][i][j], grads[0][i][j], 1e-12 + 1e-10 * std::fabs(grads[0][i][j])) << "tensor " << i;
  }
  ModelConfig cfg = moe_config();
  finalize_model_config(cfg, "1");
  ParamStore store(Device::cpu(), DType::F64, DType::F64, 42);
  GPTModel model(cfg, store);
  store.initialize();
  const Batch b = MockData(cfg.vocab_size, cfg.seq_length, 3, "train").batch(0, 2, Device::cpu());
  {  // evaluation computes the loss chunk by chunk too: the plain path's value, no logits kept
    model.set_head_chunk_rows(3);
    GPTModel::Ctx chunked_ctx, plain_ctx;
    const double chunked = model.forward(b.tokens, b.labels, false, 0, chunked_ctx);
    EXPECT_FALSE(chunked_ctx.logits.defined());
    setenv("MOECORE_FUSED_HEAD", "0", 1);
    const double plain = model.forward(b.tokens, b.labels, false, 0, plain_ctx);
    unsetenv("MOECORE_FUSED_HEAD");
    EXPECT_TRUE(plain_ctx.logits.defined());
    EXPECT_NEAR(chunked, plain, 1e-13 * std::fabs(plain));
  }
  GPTModel::Ctx ctx;
  ctx.fused_head_scale = 0.5;
  model.forward(b.tokens, b.labels, true, 7, ctx);
  try {
    model.backward(0.25, ctx);
    FAIL() << "a different grad_scale was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("differs from the fused output layer's"), std::string::npos) << e.what();
  }
}
