// Activation recomputation on the GPU (bf16 compute, fp32 masters): --recompute-modules moe,
// mlp, core_attn and shared_experts, --recompute-granularity full uniform and block give the loss and every parameter gradient
// of keeping everything, bit for bit (the recomputed forward runs the same kernels on the same
// inputs; two plain runs are compared first, so a nondeterministic kernel shows as such).
#include <gtest/gtest.h>

#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"
#include "moecore/ops/elementwise.h"

using namespace moecore;

namespace {

ModelConfig gpu_recompute_model() {
  ModelConfig c;
  c.num_layers = 3;
  c.hidden_size = 64;
  c.num_attention_heads = 2;
  c.seq_length = 48;
  c.vocab_size = 97;
  c.add_bias_linear = false;
  c.untie_embeddings = true;
  c.moe.num_experts = 8;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 48;
  c.moe.shared_expert_size = 32;
  c.moe.aux_loss_coeff = 0.01;
  c.moe.z_loss_coeff = 0.001;
  finalize_model_config(c, "[0,1,1]");
  return c;
}

struct Step {
  double loss = 0;
  std::vector<std::vector<float>> grads;
};

Step gpu_step(const RecomputeConfig& recompute) {
  ModelConfig c = gpu_recompute_model();
  c.recompute = recompute;
  ParamStore store(Device::cuda(0), DType::F32, DType::BF16, 77);  // fp32 masters, bf16 compute
  GPTModel model(c, store);
  store.initialize();
  const MockData data(c.vocab_size, c.seq_length, 5, "train");
  const Batch b = data.batch(0, 4, Device::cuda(0));
  GPTModel::Ctx ctx;
  Step s;
  s.loss = model.forward(b.tokens, b.labels, true, 3, ctx);
  model.backward(1.0, ctx);
  for (const auto& p : store.all())
    if (p->trainable) s.grads.push_back(ops::cast_to(p->grad, DType::F32).to(Device::cpu()).to_vector<float>());
  return s;
}

void expect_same(const Step& a, const Step& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << what << ": parameter " << i;
}

}  // namespace

TEST(GpuRecompute, EveryOptionGivesThePlainGradientsBitForBit) {
  const Step plain = gpu_step({});
  expect_same(plain, gpu_step({}), "a second plain run (determinism of the kernels)");
  RecomputeConfig modules;
  modules.mlp = modules.core_attn = modules.shared_experts = true;
  expect_same(plain, gpu_step(modules), "mlp + core_attn + shared_experts");
  modules.moe = true;
  expect_same(plain, gpu_step(modules), "moe + mlp + core_attn + shared_experts");
  for (const char* method : {"uniform", "block"}) {
    RecomputeConfig full;
    full.full_method = method;
    full.full_num_layers = 2;
    expect_same(plain, gpu_step(full), std::string("full ") + method);
  }
}
