// EmulatedCommunicator (comm/emulated_communicator.h): one rank of a larger world alone. Each
// collective writes outputs of the real shapes from this rank's data; splits give the rank its
// position in the group; the process groups of an emulated world are rank R's groups; the CPU
// backend allocates the MPI backend's scratch buffers (the f32 copies of bf16 reductions).
#include <gtest/gtest.h>

#include <vector>

#include "moecore/comm/emulated_communicator.h"
#include "moecore/core/allocator.h"
#include "moecore/core/memory_categories.h"
#include "moecore/core/error.h"
#include "moecore/parallel/process_groups.h"

using namespace moecore;
using namespace moecore::comm;

namespace {
Tensor iota(int64_t rows, int64_t cols, float start = 0) {
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) v[i] = start + static_cast<float>(i);
  return Tensor::from_vector(v, {rows, cols});
}
}  // namespace

TEST(EmulatedCommunicator, CollectivesKeepOrReplicateTheLocalData) {
  EmulatedCommunicator c(2, 4, Device::cpu());
  EXPECT_EQ(c.rank(), 2);
  EXPECT_EQ(c.size(), 4);
  EXPECT_TRUE(is_emulated(&c));
  Tensor t = iota(2, 3);
  c.all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(t.to_vector<float>(), iota(2, 3).to_vector<float>());
  // all_gather: the local rows in every rank's slot
  Tensor out = Tensor::zeros({8, 3}, DType::F32);
  c.all_gather(t, out);
  const std::vector<float> g = out.to_vector<float>();
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 6; ++i) EXPECT_EQ(g[static_cast<size_t>(r * 6 + i)], static_cast<float>(i));
  // reduce_scatter: this rank's rows of in
  Tensor mine = Tensor::zeros({2, 3}, DType::F32);
  c.reduce_scatter(iota(8, 3), mine, ReduceOp::Sum);
  EXPECT_EQ(mine.to_vector<float>(), iota(2, 3, 12).to_vector<float>());
  // all_to_all with symmetric counts: the rows sent to rank r come back from r
  Tensor in = iota(5, 2);
  Tensor back = Tensor::zeros({5, 2}, DType::F32);
  c.all_to_all(in, {1, 0, 3, 1}, back, {1, 0, 3, 1});
  EXPECT_EQ(back.to_vector<float>(), in.to_vector<float>());
  // counts that differ: the rows in common copied, the rest filled (deterministic, not NaN)
  Tensor more = Tensor::zeros({7, 2}, DType::F32);
  c.all_to_all(in, {1, 0, 3, 1}, more, {2, 0, 3, 2});
  const std::vector<float> m = more.to_vector<float>();
  EXPECT_EQ(m[0], 0.0f);
  EXPECT_EQ(m[1], 1.0f);
  for (float x : m) EXPECT_EQ(x, x);
  EXPECT_THROW(c.all_gather(t, mine), Error);  // the shapes are checked as the real backends do
}

TEST(EmulatedCommunicator, RecvFillsAndSelfSendsArriveInGroups) {
  EmulatedCommunicator c(0, 2, Device::cpu());
  Tensor a = Tensor::zeros({64}, DType::F32), b = Tensor::zeros({64}, DType::F32);
  c.recv(a, 1);
  EmulatedCommunicator d(0, 2, Device::cpu());
  d.recv(b, 1);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());  // deterministic
  double sum_sq = 0;
  for (float x : a.to_vector<float>()) sum_sq += x * x;
  EXPECT_GT(sum_sq, 10.0);  // not zeros: stand-in hidden states route tokens over the experts
  c.send(a, 1);             // nothing to do
  EXPECT_THROW(c.send(a, 0), Error);  // to itself only inside a group, as with MPI
  Tensor got = Tensor::zeros({64}, DType::F32);
  c.group_start();
  c.send(iota(8, 8), 0);
  c.recv(got, 0);
  c.group_end();
  EXPECT_EQ(got.to_vector<float>(), iota(8, 8).view({64}).to_vector<float>());
  Tensor ints = Tensor::from_vector(std::vector<int32_t>{5, 6}, {2});
  c.recv(ints, 1);
  EXPECT_EQ(ints.to_vector<int32_t>(), (std::vector<int32_t>{0, 0}));
}

TEST(EmulatedCommunicator, SplitGivesThePositionInTheGroup) {
  EmulatedCommunicator world(5, 8, Device::cpu());
  const std::unique_ptr<Communicator> g = world.split({1, 3, 5, 7});
  EXPECT_EQ(g->rank(), 2);
  EXPECT_EQ(g->size(), 4);
  EXPECT_TRUE(is_emulated(g.get()));
  EXPECT_THROW(world.split({0, 1}), Error);  // only members split
  EXPECT_THROW(make_emulated_world(8, 8, Device::cpu()), Error);
}

TEST(EmulatedCommunicator, ProcessGroupsAreTheRanksGroups) {
  parallel::ParallelConfig config;
  config.world = 8;
  config.tp = 2;
  config.pp = 2;
  config.ep = 2;
  const parallel::ProcessGroups groups(make_emulated_world(5, 8, Device::cpu()), config, 5);
  const parallel::ProcessGroupLayout expected = parallel::layout_for_rank(config, 5);
  ASSERT_NE(groups.tp(), nullptr);
  EXPECT_EQ(groups.tp()->size(), 2);
  EXPECT_EQ(groups.tp()->rank(), expected.tp_rank);
  EXPECT_EQ(groups.pp()->rank(), expected.pp_rank);
  EXPECT_EQ(groups.dp()->rank(), expected.dp_rank);
  EXPECT_EQ(groups.ep()->rank(), expected.ep_rank);
}

TEST(EmulatedCommunicator, Bf16ReductionsAllocateMpisScratch) {
  enable_memory_accounting();
  CachingAllocator& host = allocator_for(Device::cpu());
  EmulatedCommunicator c(0, 2, Device::cpu());
  Tensor t = Tensor::zeros({1 << 16}, DType::BF16);
  host.reset_peak();
  const int64_t before = host.stats().peak_allocated_bytes;
  c.all_reduce(t, ReduceOp::Sum);
  // MPI reduces bf16 through an f32 copy: the peak grows by it, and it is gone afterwards.
  EXPECT_GE(host.stats().peak_allocated_bytes - before, int64_t{4} << 16);
  EXPECT_EQ(host.stats().allocated_bytes, before);
}
