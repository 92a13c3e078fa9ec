// ProcessGroups under mpirun (2 or 4 ranks): for several layouts of the world, every group this
// rank gets has the size, the member order and the members the rank generator gives (an
// all-reduce of the members' global ranks over each group), groups of one rank are null, shared
// groups that span the world are the world itself, and the model / MoE / optimizer views hand out
// the same communicators.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/model/tensor_parallel.h"
#include "moecore/moe/moe_layer.h"
#include "moecore/parallel/process_groups.h"
#include "moecore/train/optimizer.h"

using namespace moecore;
using namespace moecore::parallel;

namespace {

struct Case {
  std::string name;
  int64_t world;
  int64_t tp = 1, cp = 1, pp = 1, ep = 1, etp = 1;
  bool tied = false, overlap_gather = false;
};

// The group of `ranks` (global) as this rank sees it through c.
void expect_group(comm::Communicator* c, const std::vector<int64_t>& ranks, int64_t me, const std::string& what) {
  SCOPED_TRACE(what);
  if (ranks.size() <= 1) {
    EXPECT_EQ(c, nullptr);
    return;
  }
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->size(), static_cast<int>(ranks.size()));
  const auto at = std::find(ranks.begin(), ranks.end(), me);
  ASSERT_NE(at, ranks.end());
  EXPECT_EQ(c->rank(), static_cast<int>(at - ranks.begin()));
  Tensor t = Tensor::from_vector(std::vector<int64_t>{me}, {1});
  c->all_reduce(t, comm::ReduceOp::Sum);
  EXPECT_EQ(t.to_vector<int64_t>()[0], std::accumulate(ranks.begin(), ranks.end(), int64_t{0}));
}

void check_case(const Case& k) {
  SCOPED_TRACE(k.name);
  auto world = comm::make_mpi_world();
  const int64_t me = world->rank();
  ParallelConfig pc;
  pc.world = world->size();
  pc.tp = k.tp;
  pc.cp = k.cp;
  pc.pp = k.pp;
  pc.ep = k.ep;
  pc.etp = k.etp;
  ProcessGroupOptions options;
  options.tied_embeddings = k.tied;
  options.overlap_param_gather = k.overlap_gather;
  const ProcessGroups g(std::move(world), pc, me, options);
  const ProcessGroupLayout want = layout_for_rank(pc, me);
  const ProcessGroupLayout& l = g.layout();
  EXPECT_EQ(l.tp, want.tp);
  EXPECT_EQ(l.expt_dp, want.expt_dp);
  EXPECT_EQ(l.dp_rank, want.dp_rank);
  ASSERT_NE(g.world(), nullptr);
  EXPECT_EQ(g.dp_size(), pc.dp());

  // The same order on every rank (collectives over each group).
  expect_group(g.tp(), want.tp, me, "tp");
  expect_group(g.cp(), want.cp, me, "cp");
  expect_group(g.dp(), want.dp, me, "dp");
  expect_group(g.dp_cp(), want.dp_cp, me, "dp_cp");
  expect_group(g.pp(), want.pp, me, "pp");
  const std::vector<int64_t>& token = k.tp > 1 && k.cp > 1 ? want.tp_cp : (k.tp > 1 ? want.tp : want.cp);
  expect_group(g.token_group(), token, me, "token_group");
  expect_group(g.ep(), want.ep, me, "ep");
  expect_group(g.etp(), want.expt_tp, me, "etp");
  expect_group(g.edp(), want.expt_dp, me, "edp");
  expect_group(g.tp_ep(), k.etp > 1 ? want.tp_ep : std::vector<int64_t>{}, me, "tp_ep");
  expect_group(g.dp_gather(), k.overlap_gather ? want.dp_cp : std::vector<int64_t>{}, me, "dp_gather");
  expect_group(g.edp_gather(), k.overlap_gather ? want.expt_dp : std::vector<int64_t>{}, me, "edp_gather");
  const bool embedding_member = k.tied && k.pp > 1 && (me == want.pp.front() || me == want.pp.back());
  expect_group(g.embedding(), embedding_member ? std::vector<int64_t>{want.pp.front(), want.pp.back()}
                                               : std::vector<int64_t>{},
               me, "embedding");

  // Shared groups spanning the world are the world; the others have communicators of their own.
  if (static_cast<int64_t>(want.dp.size()) == pc.world) EXPECT_EQ(g.dp(), g.world());
  if (static_cast<int64_t>(want.expt_dp.size()) == pc.world) EXPECT_EQ(g.edp(), g.world());
  if (g.tp()) EXPECT_NE(g.tp(), g.world());
  if (g.ep()) EXPECT_NE(g.ep(), g.world());
  if (k.cp == 1) EXPECT_EQ(g.dp_cp(), g.dp());

  // The views.
  const DenseParallel dense = g.dense_parallel(true);
  EXPECT_EQ(dense.tp, g.tp());
  EXPECT_EQ(dense.cp, g.cp());
  EXPECT_TRUE(dense.sequence_parallel);
  const MoeParallel moe = g.moe_parallel(DispatcherType::AllGather, false);
  EXPECT_EQ(moe.token_group, g.token_group());
  EXPECT_EQ(moe.ep, g.ep());
  EXPECT_EQ(moe.etp, g.etp());
  EXPECT_EQ(moe.tp_ep, g.tp_ep());
  EXPECT_EQ(moe.aux_group, g.dp());
  EXPECT_EQ(moe.dispatcher, DispatcherType::AllGather);
  EXPECT_EQ(moe.dense.tp, g.tp());
  EXPECT_FALSE(moe.dense.sequence_parallel);
  const OptimizerGroups opt = g.optimizer_groups();
  EXPECT_EQ(opt.dp, g.dp_cp());
  EXPECT_EQ(opt.tp, g.tp());
  EXPECT_EQ(opt.ep, g.ep());
  EXPECT_EQ(opt.edp, g.edp());
  EXPECT_EQ(opt.pp, g.pp());
  EXPECT_EQ(opt.etp, g.etp());
  EXPECT_EQ(opt.embedding, g.embedding());
  EXPECT_EQ(opt.dp_gather, g.dp_gather());
  EXPECT_EQ(opt.edp_gather, g.edp_gather());
  EXPECT_EQ(opt.dp_size, pc.dp());
}

}  // namespace

TEST(ProcessGroupsMpi, EveryGroupMatchesTheRankGenerator) {
  auto probe = comm::make_mpi_world();
  const int64_t n = probe->size();
  probe.reset();
  ASSERT_GE(n, 2) << "run this test under mpirun with at least 2 ranks";
  const std::vector<Case> cases = {
      {"dp", n, 1, 1, 1, 1, 1, false, true},
      {"tp", 2, 2},
      {"cp", 2, 1, 2},
      {"pp tied", 2, 1, 1, 2, 1, 1, true},
      {"ep", n, 1, 1, 1, 2},
      {"etp", 2, 1, 1, 1, 1, 2},
      {"tp x cp", 4, 2, 2},
      {"tp ep", 4, 2, 1, 1, 2},
      {"ep etp overlap", 4, 1, 1, 1, 2, 2, false, true},
      {"pp tp tied overlap", 4, 2, 1, 2, 1, 1, true, true},
      {"cp dp overlap", 4, 1, 2, 1, 1, 1, false, true},
  };
  for (const Case& k : cases) {
    if (k.world != n) continue;
    check_case(k);
  }
}
