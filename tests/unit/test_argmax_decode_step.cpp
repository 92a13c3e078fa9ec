// ops::argmax_rows on the CPU (the first largest value, as std::max_element; bad arguments
// refused by name) and DecodeStep on the CPU: each step's greedy tokens equal the argmax of its
// logits, a sampling step returns the logits, and out-of-range tokens and positions are refused.
#include <gtest/gtest.h>

#include <algorithm>

#include "moecore/model/gpt.h"
#include "moecore/ops/argmax.h"
#include "moecore/train/decode_step.h"

using namespace moecore;

TEST(ArgmaxRows, FirstLargestPerRow) {
  const Tensor x = Tensor::from_vector(std::vector<float>{1, 5, 5, 2, -3, -1, -1, -7, 0, 0, 0, 0}, {3, 4});
  Tensor out = Tensor::empty({3}, DType::I32);
  ops::argmax_rows(x, out);
  EXPECT_EQ(out.to_vector<int32_t>(), (std::vector<int32_t>{1, 1, 0}));
}

TEST(ArgmaxRows, RefusesBadArguments) {
  Tensor out = Tensor::empty({2}, DType::I32);
  EXPECT_THROW(ops::argmax_rows(Tensor::zeros({2, 3}, DType::F64), out), Error);
  EXPECT_THROW(ops::argmax_rows(Tensor::zeros({3, 3}, DType::F32), out), Error);
  EXPECT_THROW(ops::argmax_rows(Tensor::zeros({2, 0}, DType::F32), out), Error);
}

TEST(DecodeStepCpu, GreedyTokensAreTheLogitsArgmax) {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.seq_length = 16;
  c.vocab_size = 40;
  c.add_bias_linear = false;
  c.swiglu = true;
  c.init_method_std = 0.2;
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 16;
  finalize_model_config(c, "1");
  ParamStore store(Device::cpu(), DType::F32, DType::F32, 5);
  GPTModel model(c, store);
  store.initialize();
  GPTModel::KvCache greedy_cache = model.make_kv_cache(2, 8, Device::cpu());
  GPTModel::KvCache sample_cache = model.make_kv_cache(2, 8, Device::cpu());
  DecodeStep greedy(model, greedy_cache, Device::cpu(), true, true);
  DecodeStep sample(model, sample_cache, Device::cpu(), false, true);
  EXPECT_EQ(greedy.graph_status(), "eager");  // no graphs on the CPU
  std::vector<int32_t> tokens{3, 17};
  for (int64_t step = 0; step < 5; ++step) {
    const std::vector<int64_t> positions{step, step};  // every key a row attends to was written
    greedy.run(tokens, positions);
    sample.run(tokens, positions);
    const std::vector<float>& l = sample.logits();
    ASSERT_EQ(l.size(), 2u * 40u);
    for (size_t r = 0; r < 2; ++r) {
      const auto row = l.begin() + static_cast<std::ptrdiff_t>(r * 40);
      EXPECT_EQ(greedy.greedy_tokens()[r], static_cast<int32_t>(std::max_element(row, row + 40) - row)) << step;
    }
    tokens = greedy.greedy_tokens();
  }
  EXPECT_THROW(greedy.run({3, 40}, {6, 6}), Error);  // token outside the vocabulary
  EXPECT_THROW(greedy.run({3, 4}, {8, 6}), Error);   // position outside the cache
  EXPECT_THROW(greedy.run({3}, {6}), Error);         // one row of two
  // cached_logits' one-token-per-row path (decode_logits) checks the positions as well
  const Tensor step_tokens = Tensor::from_vector(std::vector<int32_t>{3, 4}, {2, 1});
  try {
    model.cached_logits(step_tokens, 0, {2, 8}, greedy_cache);
    ADD_FAILURE() << "no error for a position outside the KV cache";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cached_logits: row 1 at position 8 is outside the KV cache of 8 positions"),
              std::string::npos)
        << e.what();
  }
}
