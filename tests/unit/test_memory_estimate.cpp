// The state-memory lower bound (train/memory_estimate.h): bytes per parameter for fp32 and bf16
// runs, the split over tensor / pipeline / expert parallelism and the distributed optimizer.
#include <gtest/gtest.h>

#include "moecore/model/param_count.h"
#include "moecore/train/memory_estimate.h"

using namespace moecore;

namespace {
ModelConfig moe_config() {
  ModelConfig c;
  c.num_layers = 2;
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.seq_length = 8;
  c.vocab_size = 64;
  c.add_bias_linear = false;
  c.moe.num_experts = 4;
  c.moe.router.topk = 2;
  c.moe.ffn_hidden_size = 48;
  finalize_model_config(c, "1");
  return c;
}
}  // namespace

TEST(MemoryEstimate, Fp32WeightsGradientsAndMoments) {
  const ModelConfig c = moe_config();
  const StateMemory m = estimate_state_memory(c, StateLayout{});
  EXPECT_EQ(m.params, count_parameters(c).total);
  EXPECT_DOUBLE_EQ(m.params_per_rank, static_cast<double>(m.params));
  EXPECT_DOUBLE_EQ(m.bytes_per_rank, 16.0 * static_cast<double>(m.params));  // weight, grad, 2 moments
}

TEST(MemoryEstimate, SplitOverTheLayout) {
  const ModelConfig c = moe_config();
  const ParamCount count = count_parameters(c);
  const double experts = static_cast<double>(count.part("routed_experts"));
  ASSERT_GT(experts, 0);
  StateLayout l;
  l.tp = 2;
  l.ep = 4;
  l.dp = 4;
  l.bf16 = true;
  l.distributed_optimizer = true;
  const StateMemory m = estimate_state_memory(c, l);
  const double per_rank = (static_cast<double>(count.total) - experts) / 2 + experts / 4;
  EXPECT_DOUBLE_EQ(m.params_per_rank, per_rank);
  EXPECT_DOUBLE_EQ(m.bytes_per_rank, per_rank * (2 * 2 + (2.0 + 8.0) / 4));
}

TEST(MemoryEstimate, DeviceMemoryOfTheCpu) {
  const double one = device_memory_bytes(false, 0, 1);
  EXPECT_GT(one, 0);
  EXPECT_DOUBLE_EQ(device_memory_bytes(false, 0, 4), one / 4);
}
