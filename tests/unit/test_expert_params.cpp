// Expert parameters under expert parallelism (model/params.h): a rank holding experts
// [first, first + L) draws exactly the rows the single-rank model draws for them, and the
// gradient/master buffers keep dense and expert parameters apart.
#include <gtest/gtest.h>

#include "moecore/model/params.h"

using namespace moecore;

TEST(ExpertParams, ShardedInitEqualsTheSingleRankRows) {
  ParamStore full(Device::cpu(), DType::F32, DType::F32, 99);
  full.add("dense.weight", {3, 5}, Init::Normal, 0.02, true);
  Param& all = full.add_expert("experts.linear_fc1.weight", {4, 6, 5}, 4, 0, 0.02);
  full.initialize();
  for (int64_t first : {0, 1, 2, 3}) {
    for (int64_t rows : {1, 2}) {
      if (first + rows > 4) continue;
      ParamStore part(Device::cpu(), DType::F32, DType::F32, 99);
      part.add("dense.weight", {3, 5}, Init::Normal, 0.02, true);
      Param& mine = part.add_expert("experts.linear_fc1.weight", {rows, 6, 5}, 4, first, 0.02);
      part.initialize();
      EXPECT_TRUE(mine.sharded() || rows == 4);
      EXPECT_EQ(mine.full_shape(), (Shape{4, 6, 5}));
      const std::vector<float> want = all.master.slice(0, first, first + rows).contiguous().to_vector<float>();
      EXPECT_EQ(mine.master.to_vector<float>(), want) << "experts [" << first << ", " << first + rows << ")";
      EXPECT_EQ(part.get("dense.weight").master.to_vector<float>(), full.get("dense.weight").master.to_vector<float>());
    }
  }
}

TEST(ExpertParams, DenseAndExpertGradientsLiveInSeparateBuffers) {
  ParamStore s(Device::cpu(), DType::F32, DType::F32, 1);
  Param& d = s.add("a", {10}, Init::Normal, 0.02, true);
  Param& e = s.add_expert("b", {2, 7}, 4, 2, 0.02);
  s.add_buffer("c", {4});
  s.initialize(/*dense_shard_multiple=*/3, /*expert_shard_multiple=*/2);
  EXPECT_EQ(s.grad_buffer().numel() % (64 * 3), 0);
  EXPECT_EQ(s.expert_grad_buffer().numel() % (64 * 2), 0);
  EXPECT_EQ(d.grad.data_ptr(), s.grad_buffer().data_ptr());
  EXPECT_EQ(e.grad.data_ptr(), s.expert_grad_buffer().data_ptr());
  EXPECT_EQ(e.master.data_ptr(), s.expert_master_buffer().data_ptr());
  EXPECT_EQ(d.weight.data_ptr(), d.master.data_ptr());  // f32 compute: the weight is the master
  EXPECT_THROW(s.add_expert("bad", {3, 2}, 4, 2, 0.02), Error);  // rows [2, 5) of 4
}
