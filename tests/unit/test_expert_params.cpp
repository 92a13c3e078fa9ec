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

// Expert tensor parallelism: part r of fc1 is [gate rows of part r; up rows of part r] of each
// expert, part r of fc2 its columns of part r; the parts drawn by each ETP rank are exactly
// those of the single-rank tensor, and part_assemble puts them back together bit for bit.
TEST(ExpertParams, EtpPartsEqualTheSingleRankSlices) {
  const int64_t e = 4, f = 6, h = 5, etp = 3;
  ParamStore full(Device::cpu(), DType::F32, DType::F32, 7);
  Param& fc1 = full.add_expert("experts.linear_fc1.weight", {e, 2 * f, h}, e, 0, 0.02);
  Param& fc2 = full.add_expert("experts.linear_fc2.weight", {e, h, f}, e, 0, 0.02);
  full.initialize();
  const std::vector<float> w1 = fc1.master.to_vector<float>(), w2 = fc2.master.to_vector<float>();
  const int64_t fl = f / etp;
  std::vector<Tensor> parts1, parts2;
  for (int64_t r = 0; r < etp; ++r) {
    ParamStore part(Device::cpu(), DType::F32, DType::F32, 7);
    // experts [2, 4) of the 4, as EP rank 1 of 2 would hold them
    Param& p1 = part.add_expert("experts.linear_fc1.weight", {2, 2 * fl, h}, e, 2, 0.02, etp, r, 1, true);
    Param& p2 = part.add_expert("experts.linear_fc2.weight", {2, h, fl}, e, 2, 0.02, etp, r, 2);
    part.initialize();
    EXPECT_EQ(p1.full_shape(), (Shape{e, 2 * f, h}));
    EXPECT_EQ(p2.full_shape(), (Shape{e, h, f}));
    const std::vector<float> a = p1.master.to_vector<float>(), b = p2.master.to_vector<float>();
    for (int64_t x = 0; x < 2; ++x) {
      const int64_t ex = 2 + x;
      for (int64_t i = 0; i < 2 * fl; ++i) {
        const int64_t row = i < fl ? r * fl + i : f + r * fl + (i - fl);  // gate half, then up half
        for (int64_t k = 0; k < h; ++k)
          ASSERT_EQ(a[static_cast<size_t>((x * 2 * fl + i) * h + k)], w1[static_cast<size_t>((ex * 2 * f + row) * h + k)])
              << "fc1 part " << r << " expert " << ex << " row " << i;
      }
      for (int64_t i = 0; i < h; ++i)
        for (int64_t k = 0; k < fl; ++k)
          ASSERT_EQ(b[static_cast<size_t>((x * h + i) * fl + k)], w2[static_cast<size_t>((ex * h + i) * f + r * fl + k)])
              << "fc2 part " << r << " expert " << ex;
    }
    parts1.push_back(p1.master.clone());
    parts2.push_back(p2.master.clone());
    if (r == 0) {
      // part_take of the full experts [2, 4) gives this part back
      EXPECT_EQ(part_take(p1, fc1.master.slice(0, 2, 4).contiguous()).to_vector<float>(), a);
    }
  }
  // all parts, rank-major as all_gather returns them -> the experts [2, 4) of the full tensors
  ParamStore probe(Device::cpu(), DType::F32, DType::F32, 7);
  Param& q1 = probe.add_expert("fc1", {2, 2 * fl, h}, e, 2, 0.02, etp, 0, 1, true);
  Param& q2 = probe.add_expert("fc2", {2, h, fl}, e, 2, 0.02, etp, 0, 2);
  auto stack = [](const std::vector<Tensor>& ts) {
    std::vector<float> all;
    for (const Tensor& t : ts) {
      const std::vector<float> v = t.to_vector<float>();
      all.insert(all.end(), v.begin(), v.end());
    }
    Shape s = ts[0].shape();
    s[0] *= static_cast<int64_t>(ts.size());
    return Tensor::from_vector(all, s);
  };
  EXPECT_EQ(part_assemble(q1, stack(parts1)).to_vector<float>(), fc1.master.slice(0, 2, 4).contiguous().to_vector<float>());
  EXPECT_EQ(part_assemble(q2, stack(parts2)).to_vector<float>(), fc2.master.slice(0, 2, 4).contiguous().to_vector<float>());
}
