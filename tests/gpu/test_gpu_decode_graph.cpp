// CUDA-graph decoding (train/decode_step.h) against the same steps launched one by one: a tiny
// MoE model (GQA, q/k norms, bf16: the expert GEMMs read device-side offsets, so the step can be
// captured) decoded greedily for 1 and 3 rows of different lengths gives the same logits bit
// for bit and the same tokens at every step; generate_tokens gives the same tokens with and
// without graphs (greedy and sampled); in fp32 (the expert GEMMs read their counts on the host)
// the capture fails and the steps run eagerly with the same tokens. Also ops::argmax_rows on the
// GPU against the CPU (ties: the first index).
#include <gtest/gtest.h>

#include <cstring>

#include "moecore/model/gpt.h"
#include "moecore/ops/argmax.h"
#include "moecore/ops/elementwise.h"
#include "moecore/train/decode_step.h"
#include "moecore/train/generation.h"
#include "op_harness.h"

using namespace moecore;

namespace {

ModelConfig tiny_moe() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 128;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.kv_channels = 64;
  c.seq_length = 64;
  c.vocab_size = 96;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.untie_embeddings = true;
  c.qk_layernorm = true;
  c.init_method_std = 0.2;  // logits far from uniform
  c.moe.num_experts = 8;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 96;
  finalize_model_config(c, "1");
  return c;
}

std::vector<std::vector<int32_t>> prompts(int64_t rows) {
  std::vector<std::vector<int32_t>> p(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < 3 + 4 * r; ++i) p[static_cast<size_t>(r)].push_back(static_cast<int32_t>((7 * i + 13 * r + 3) % 96));
  return p;
}

// Prefills every prompt into `cache`; returns each row's first greedy token and last position.
void prefill(GPTModel& model, const std::vector<std::vector<int32_t>>& p, GPTModel::KvCache& cache, Device dev,
             std::vector<int32_t>& tokens, std::vector<int64_t>& positions) {
  tokens.clear();
  positions.clear();
  for (size_t r = 0; r < p.size(); ++r) {
    const int64_t len = static_cast<int64_t>(p[r].size());
    Tensor l = model.cached_logits(Tensor::from_vector(p[r], {1, len}, dev), static_cast<int64_t>(r), {0}, cache);
    Tensor f = Tensor::empty(l.shape(), DType::F32, dev), id = Tensor::empty({1}, DType::I32, dev);
    ops::cast(l, f);
    ops::argmax_rows(f, id);
    tokens.push_back(id.to_vector<int32_t>()[0]);
    positions.push_back(len);
  }
}

void expect_graph_equals_eager(int64_t rows) {
  const ModelConfig cfg = tiny_moe();
  const Device dev = Device::cuda(0);
  ParamStore store(dev, DType::F32, DType::BF16, 91);
  GPTModel model(cfg, store);
  store.initialize();
  const auto p = prompts(rows);
  const int64_t max_len = 3 + 4 * (rows - 1) + 24;
  GPTModel::KvCache eager_cache = model.make_kv_cache(rows, max_len, dev);
  GPTModel::KvCache graph_cache = model.make_kv_cache(rows, max_len, dev);
  std::vector<int32_t> tokens, graph_tokens;
  std::vector<int64_t> positions, graph_positions;
  prefill(model, p, eager_cache, dev, tokens, positions);
  prefill(model, p, graph_cache, dev, graph_tokens, graph_positions);
  ASSERT_EQ(tokens, graph_tokens);
  DecodeStep eager(model, eager_cache, dev, true, false);
  DecodeStep graph(model, graph_cache, dev, true, true);
  EXPECT_EQ(eager.graph_status(), "eager");
  for (int step = 0; step < 20; ++step) {
    eager.run(tokens, positions);
    graph.run(tokens, positions);
    const std::vector<float> a = eager.device_logits().to_vector<float>(), b = graph.device_logits().to_vector<float>();
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "logits differ at step " << step;
    EXPECT_EQ(eager.greedy_tokens(), graph.greedy_tokens()) << "step " << step;
    tokens = graph.greedy_tokens();
    for (int64_t& q : positions) ++q;
  }
  EXPECT_EQ(graph.graph_status(), "cuda-graph");
  EXPECT_TRUE(graph.replaying());
  for (MoeLayer* l : model.moe_layers()) l->check_evaluation_routing();
}

GenerationOutput generate(GPTModel& model, const std::vector<std::vector<int32_t>>& p, double temperature, bool graph) {
  GenerationOptions opt;
  opt.max_new_tokens = 16;
  opt.temperature = temperature;
  opt.top_k = 20;
  opt.seed = 5;
  opt.cuda_graph = graph;
  return generate_tokens(model, Device::cuda(0), p, opt);
}

}  // namespace

TEST(GpuDecodeGraph, OneRowGraphEqualsEagerBitForBit) {
  MC_REQUIRE_CUDA();
  expect_graph_equals_eager(1);
}

TEST(GpuDecodeGraph, ThreeRowsGraphEqualsEagerBitForBit) {
  MC_REQUIRE_CUDA();
  expect_graph_equals_eager(3);
}

TEST(GpuDecodeGraph, GenerateTokensSameWithAndWithoutGraphs) {
  MC_REQUIRE_CUDA();
  const ModelConfig cfg = tiny_moe();
  ParamStore store(Device::cuda(0), DType::F32, DType::BF16, 92);
  GPTModel model(cfg, store);
  store.initialize();
  for (int64_t rows : {1, 4})
    for (double temperature : {0.0, 0.8}) {
      const GenerationOutput eager = generate(model, prompts(rows), temperature, false);
      const GenerationOutput graph = generate(model, prompts(rows), temperature, true);
      EXPECT_EQ(eager.new_tokens, graph.new_tokens) << rows << " rows, temperature " << temperature;
      EXPECT_EQ(eager.decode_path, "eager");
      EXPECT_EQ(graph.decode_path, "cuda-graph") << rows << " rows, temperature " << temperature;
    }
  for (MoeLayer* l : model.moe_layers()) l->check_evaluation_routing();
}

TEST(GpuDecodeGraph, Fp32CaptureFailsAndDecodesEagerly) {
  MC_REQUIRE_CUDA();
  const ModelConfig cfg = tiny_moe();
  ParamStore store(Device::cuda(0), DType::F32, DType::F32, 93);
  GPTModel model(cfg, store);
  store.initialize();
  const GenerationOutput eager = generate(model, prompts(2), 0.0, false);
  const GenerationOutput graph = generate(model, prompts(2), 0.0, true);
  EXPECT_EQ(eager.new_tokens, graph.new_tokens);
  EXPECT_EQ(graph.decode_path.rfind("eager: the CUDA graph capture failed", 0), 0u) << graph.decode_path;
}

TEST(GpuDecodeGraph, SecondStepAtOnceRunsEagerly) {
  MC_REQUIRE_CUDA();
  const ModelConfig cfg = tiny_moe();
  const Device dev = Device::cuda(0);
  ParamStore store(dev, DType::F32, DType::BF16, 94);
  GPTModel model(cfg, store);
  store.initialize();
  GPTModel::KvCache a = model.make_kv_cache(1, 8, dev), b = model.make_kv_cache(1, 8, dev);
  DecodeStep first(model, a, dev, true, true);
  DecodeStep second(model, b, dev, true, true);
  EXPECT_EQ(second.graph_status(), "eager: another decoding step holds this device's graph stream");
}

TEST(GpuDecodeGraph, ArgmaxRowsMatchesCpu) {
  MC_REQUIRE_CUDA();
  const int64_t rows = 5, cols = 40000;
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 2654435761u) % 1000) * 0.01f;
  x[static_cast<size_t>(2 * cols + 17)] = 50.f;  // row 2: a tie, the first wins
  x[static_cast<size_t>(2 * cols + 39000)] = 50.f;
  x[static_cast<size_t>(4 * cols + cols - 1)] = 60.f;  // row 4: the last column
  Tensor host = Tensor::from_vector(x, {rows, cols}), host_out = Tensor::empty({rows}, DType::I32);
  ops::argmax_rows(host, host_out);
  Tensor dev = host.to(Device::cuda(0)), dev_out = Tensor::empty({rows}, DType::I32, Device::cuda(0));
  ops::argmax_rows(dev, dev_out);
  EXPECT_EQ(host_out.to_vector<int32_t>(), dev_out.to_vector<int32_t>());
  EXPECT_EQ(dev_out.to_vector<int32_t>()[2], 17);
  EXPECT_EQ(dev_out.to_vector<int32_t>()[4], cols - 1);
}
