// Fine-grained activation offloading on the CPU (a separate host buffer, synchronous copies):
// the loss and every parameter gradient of keeping everything, bit for bit, for one micro-batch
// and for three whose forwards and backwards interleave as in a pipeline schedule (the stash is
// per micro-batch, the prefetch crosses to the next micro-batch); with selective recomputation
// of the same modules; on a pipeline stage without the embedding. The host memory is handed
// back after each backward. The names of --offload-modules.
#include <gtest/gtest.h>

#include "moecore/data/mock_data.h"
#include "moecore/model/gpt.h"

using namespace moecore;

namespace {

ModelConfig offload_model() {
  ModelConfig c;
  c.num_layers = 4;
  c.hidden_size = 32;
  c.num_attention_heads = 2;
  c.seq_length = 16;
  c.vocab_size = 53;
  c.add_bias_linear = false;
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 24;
  c.moe.shared_expert_size = 16;
  c.moe.aux_loss_coeff = 0.01;
  finalize_model_config(c, "[0,1,1,1]");
  return c;
}

struct Step {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;
};

// order: the micro-batches' forwards, then their backwards (oldest first).
Step cpu_step(const std::vector<std::string>& offload, bool recompute, size_t micro_batches,
              const PipelineStage& stage = {}) {
  ModelConfig c = offload_model();
  c.offload_modules = offload;
  if (recompute) {
    c.moe.recompute_act = true;
    c.recompute.core_attn = c.recompute.mlp = true;
  }
  ParamStore store(Device::cpu(), DType::F32, DType::F32, 11);
  GPTModel model(c, store, {}, stage);
  store.initialize();
  const MockData data(c.vocab_size, c.seq_length, 5, "train");
  std::vector<GPTModel::Ctx> ctx(micro_batches);
  Step s;
  for (size_t m = 0; m < micro_batches; ++m) {
    const Batch b = data.batch(static_cast<int64_t>(m) * 2, 2, Device::cpu());
    Tensor hidden;
    if (!stage.has_embedding) {  // the previous stage's output: any fixed values
      hidden = Tensor::empty({b.tokens.numel(), c.hidden_size}, DType::F32);
      float* h = hidden.data<float>();
      for (int64_t i = 0; i < hidden.numel(); ++i) h[i] = 0.01f * static_cast<float>((i * 7 + static_cast<int64_t>(m)) % 13);
    }
    s.losses.push_back(model.forward(b.tokens, b.labels, true, 3 + m, ctx[m], hidden));
  }
  for (size_t m = 0; m < micro_batches; ++m) {
    Tensor d_out;
    if (!stage.has_head) d_out = Tensor::zeros(ctx[m].hidden_out.shape(), DType::F32);
    if (d_out.defined()) d_out.data<float>()[m] = 1.0f;
    model.backward(0.5, ctx[m], {}, d_out);
  }
  EXPECT_EQ(offload_host_usage().now, 0) << "host memory of offloaded activations kept after the backward";
  for (const auto& p : store.all())
    if (p->trainable) s.grads.push_back(p->grad.to_vector<float>());
  return s;
}

void expect_same(const Step& a, const Step& b, const std::string& what) {
  EXPECT_EQ(a.losses, b.losses) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << what << ": parameter " << i;
}

const std::vector<std::string> kEveryModule = {"attn_norm", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"};

}  // namespace

TEST(ActivationOffload, GivesThePlainGradientsBitForBit) {
  for (size_t micro_batches : {size_t{1}, size_t{3}}) {
    const std::string n = std::to_string(micro_batches) + " micro-batch(es): ";
    const Step plain = cpu_step({}, false, micro_batches);
    const Step every = cpu_step(kEveryModule, false, micro_batches);
    expect_same(plain, every, n + "every module");
    expect_same(plain, cpu_step({"expert_fc1", "moe_act"}, false, micro_batches), n + "expert_fc1 + moe_act");
    expect_same(cpu_step({}, true, micro_batches), cpu_step(kEveryModule, true, micro_batches),
                n + "every module, moe_act, core_attn and mlp recomputed");
  }
  EXPECT_GT(offload_host_usage().peak, 0);
}

TEST(ActivationOffload, PipelineStageWithoutEmbeddingOrHead) {
  PipelineStage middle;
  middle.first_layer = 1;
  middle.end_layer = 3;
  middle.has_embedding = middle.has_head = false;
  expect_same(cpu_step({}, false, 2, middle), cpu_step(kEveryModule, false, 2, middle), "layers [1, 3), 2 micro-batches");
}

TEST(ActivationOffload, ModuleNames) {
  const OffloadModules m = parse_offload_modules({"expert_fc1", "moe_act"});
  EXPECT_TRUE(m.has(OffloadModule::kExpertFc1) && m.has(OffloadModule::kMoeAct) && !m.has(OffloadModule::kAttnNorm));
  EXPECT_FALSE(parse_offload_modules({}).any());
  EXPECT_EQ(offload_module_names(), "attn_norm, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act");
  try {
    parse_offload_modules({"layernorm"});
    FAIL() << "an unknown module was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--offload-modules 'layernorm': expected one of attn_norm, core_attn"),
              std::string::npos)
        << e.what();
  }
}
