// Golden tests for the parallel layout (RankGenerator, Parallel Folding), against hand-worked
// examples (Megatron's rank generator: order tp-cp-ep-dp-pp, the left-most dimension fastest; a
// 16-rank TP2 CP2 DP2 PP2 / ETP1 EP4 EDP2 PP2 layout) and against an independent reference that groups
// ranks by their coordinates instead of enumerating group/member indices.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "moecore/core/error.h"
#include "moecore/parallel/parallel_config.h"
#include "moecore/parallel/rank_generator.h"

using namespace moecore;
using namespace moecore::parallel;

using Groups = std::vector<std::vector<int64_t>>;

namespace {

// [0],[1],...,[world-1]
Groups singletons(int64_t world) {
  Groups g;
  for (int64_t r = 0; r < world; ++r) g.push_back({r});
  return g;
}

std::string to_string(const Groups& groups) {
  std::string s;
  for (const auto& g : groups) {
    s += "[";
    for (size_t i = 0; i < g.size(); ++i) {
      if (i) s += ",";
      s += std::to_string(g[i]);
    }
    s += "]";
  }
  return s;
}

// Independent reference: rank -> coordinate along each name of `order` (left-most fastest, by
// repeated div/mod); two ranks share a group iff they agree on every coordinate not in `mask`.
// Members ascending, groups by first member (Megatron's enumeration gives exactly that order).
Groups reference_groups(const std::vector<std::string>& order, const std::map<std::string, int64_t>& size,
                        const std::vector<std::string>& mask) {
  int64_t world = 1;
  for (const auto& n : order) world *= size.at(n);
  std::map<std::vector<int64_t>, std::vector<int64_t>> by_key;
  for (int64_t r = 0; r < world; ++r) {
    int64_t rest = r;
    std::vector<int64_t> key;
    for (const auto& n : order) {
      const int64_t coord = rest % size.at(n);
      rest /= size.at(n);
      if (std::find(mask.begin(), mask.end(), n) == mask.end()) key.push_back(coord);
    }
    by_key[key].push_back(r);
  }
  Groups out;
  for (auto& [k, g] : by_key) out.push_back(g);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t dash = s.find('-', start);
    out.push_back(s.substr(start, dash - start));
    if (dash == std::string::npos) return out;
    start = dash + 1;
  }
}

struct KindRef {
  std::string kind;
  bool expert;
  std::string mask;
};
const std::vector<KindRef> kKinds = {
    {"tp", false, "tp"},       {"cp", false, "cp"},         {"dp", false, "dp"},     {"dp_cp", false, "dp-cp"},
    {"pp", false, "pp"},       {"tp_cp", false, "tp-cp"},   {"tp_dp_cp", false, "tp-dp-cp"},
    {"mp", false, "tp-pp"},    {"ep", true, "ep"},          {"expt_tp", true, "tp"}, {"expt_dp", true, "dp"},
    {"tp_ep", true, "tp-ep"},  {"tp_ep_pp", true, "tp-ep-pp"}};

Groups reference_kind(const ParallelConfig& c, const KindRef& k) {
  std::vector<std::string> order = split(c.order);
  for (const char* n : {"tp", "cp", "ep", "dp", "pp"})
    if (std::find(order.begin(), order.end(), n) == order.end()) order.push_back(n);
  std::map<std::string, int64_t> size;
  if (k.expert)
    size = {{"tp", c.etp}, {"cp", 1}, {"ep", c.ep}, {"dp", c.edp()}, {"pp", c.pp}};
  else
    size = {{"tp", c.tp}, {"cp", c.cp}, {"ep", 1}, {"dp", c.dp()}, {"pp", c.pp}};
  return reference_groups(order, size, split(k.mask));
}

int64_t expected_group_size(const ParallelConfig& c, const std::string& kind) {
  const std::map<std::string, int64_t> m = {
      {"tp", c.tp},           {"cp", c.cp},       {"dp", c.dp()},          {"dp_cp", c.dp() * c.cp},
      {"pp", c.pp},           {"tp_cp", c.tp * c.cp}, {"tp_dp_cp", c.tp * c.dp() * c.cp}, {"mp", c.tp * c.pp},
      {"ep", c.ep},           {"expt_tp", c.etp}, {"expt_dp", c.edp()},    {"tp_ep", c.etp * c.ep},
      {"tp_ep_pp", c.etp * c.ep * c.pp}};
  return m.at(kind);
}

// Each rank in exactly one group; every group of the product size; members ascending.
void expect_partition(const ParallelConfig& c, const std::string& kind) {
  const Groups groups = all_groups(c, kind);
  const int64_t size = expected_group_size(c, kind);
  std::vector<int> seen(c.world, 0);
  for (const auto& g : groups) {
    EXPECT_EQ(static_cast<int64_t>(g.size()), size) << kind;
    EXPECT_TRUE(std::is_sorted(g.begin(), g.end())) << kind;
    for (int64_t r : g) {
      ASSERT_TRUE(r >= 0 && r < c.world) << kind << " rank " << r;
      ++seen[r];
    }
  }
  EXPECT_EQ(static_cast<int64_t>(groups.size()) * size, c.world) << kind;
  for (int64_t r = 0; r < c.world; ++r) EXPECT_EQ(seen[r], 1) << kind << " rank " << r;
}

ParallelConfig config16() {  // the worked example: TP2 CP2 DP2 PP2 / ETP1 EP4 EDP2 PP2
  ParallelConfig c;
  c.world = 16;
  c.tp = 2;
  c.cp = 2;
  c.pp = 2;
  c.ep = 4;
  c.etp = 1;
  return c;
}

std::string error_of(const ParallelConfig& c, const ModelDims& d) {
  try {
    validate(c, d);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

// 16 ranks, default order tp-cp-ep-dp-pp.
// Dense sizes (tp,cp,ep,dp,pp) = (2,2,1,2,2), strides (1,2,4,4,8): rank = tp + 2cp + 4dp + 8pp.
// Expert sizes (2 -> etp 1, cp 1, ep 4, edp 2, pp 2), strides (1,1,1,4,8): rank = ep + 4edp + 8pp.
TEST(RankGenerator, SixteenRankWorkedExampleAllGroups) {
  const ParallelConfig c = config16();
  EXPECT_EQ(c.dp(), 2);
  EXPECT_EQ(c.edp(), 2);
  const std::map<std::string, Groups> golden = {
      {"tp", {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}},
      {"cp", {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}},
      {"dp", {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}},
      {"dp_cp", {{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}},
      {"pp", {{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}},
      {"tp_cp", {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}},
      {"tp_dp_cp", {{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}},
      {"mp", {{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}},
      {"ep", {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}},
      {"expt_tp", singletons(16)},
      {"expt_dp", {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}},
      {"tp_ep", {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}},
      {"tp_ep_pp", {{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}},
  };
  ASSERT_EQ(golden.size(), group_kinds().size());
  for (const auto& [kind, groups] : golden) EXPECT_EQ(to_string(all_groups(c, kind)), to_string(groups)) << kind;
  // Both generators give the same pp groups.
  EXPECT_EQ(dense_generator(c).get_ranks("pp"), expert_generator(c).get_ranks("pp"));
}

// Parallel Folding: EP4 runs over the ranks attention splits by TP2 x CP2.
TEST(RankGenerator, SixteenRankEpFoldsOverTpCp) {
  const ParallelConfig c = config16();
  EXPECT_EQ(all_groups(c, "ep"), all_groups(c, "tp_cp"));
  // every EP group is a union of whole TP groups and of whole CP groups
  for (const auto& eg : all_groups(c, "ep"))
    for (const char* k : {"tp", "cp"})
      for (const auto& g : all_groups(c, k)) {
        const auto n = std::count_if(g.begin(), g.end(),
                                     [&](int64_t r) { return std::find(eg.begin(), eg.end(), r) != eg.end(); });
        EXPECT_TRUE(n == 0 || n == static_cast<long>(g.size())) << k;
      }
}

// Megatron's "tp-cp-ep-pp-dp" (pp before dp; allowed because EDP == DP), sizes all different:
// world 24, TP3 CP1 PP2 -> DP4; ETP1 EP3 PP2 -> EDP4.
//   dense (tp,cp,ep,pp,dp) = (3,1,1,2,4), strides (1,3,3,3,6): rank = tp + 3pp + 6dp
//     tp: [3g, 3g+1, 3g+2]                                  (8 groups)
//     pp: members +0,+3; base = g%3 + 6(g/3): [0,3],[1,4],[2,5],[6,9],...,[20,23]
//     dp: members +0,+6,+12,+18; base = g (g < 6)
//     mp (tp-pp): [6g .. 6g+5]
//   expert (1,1,3,2,4), strides (1,1,1,3,6): rank = ep + 3pp + 6edp
//     ep: [3g, 3g+1, 3g+2] (= dense tp: EP folded over TP); expt_dp = dense dp;
//     pp: base = ep + 6 edp = g%3 + 6(g/3), same as dense; tp_ep_pp: [6g .. 6g+5]
// With the default order (pp slowest) pp would be [0,12],... and dp [0,3,6,9],...: an
// order or stride mix-up (e.g. reading the order right-most fastest) fails here.
TEST(RankGenerator, HandWorkedPpBeforeDpOrder) {
  ParallelConfig c;
  c.world = 24;
  c.tp = 3;
  c.pp = 2;
  c.ep = 3;
  c.etp = 1;
  c.order = "tp-cp-ep-pp-dp";
  ASSERT_EQ(c.dp(), 4);
  ASSERT_EQ(c.edp(), 4);
  Groups tp, pp, dp, mp;
  for (int64_t g = 0; g < 8; ++g) tp.push_back({3 * g, 3 * g + 1, 3 * g + 2});
  for (int64_t g = 0; g < 12; ++g) pp.push_back({g % 3 + 6 * (g / 3), g % 3 + 6 * (g / 3) + 3});
  for (int64_t g = 0; g < 6; ++g) dp.push_back({g, g + 6, g + 12, g + 18});
  for (int64_t g = 0; g < 4; ++g) mp.push_back({6 * g, 6 * g + 1, 6 * g + 2, 6 * g + 3, 6 * g + 4, 6 * g + 5});
  EXPECT_EQ(to_string(pp), "[0,3][1,4][2,5][6,9][7,10][8,11][12,15][13,16][14,17][18,21][19,22][20,23]");
  EXPECT_EQ(all_groups(c, "tp"), tp);
  EXPECT_EQ(all_groups(c, "cp"), singletons(24));
  EXPECT_EQ(all_groups(c, "pp"), pp);
  EXPECT_EQ(all_groups(c, "dp"), dp);
  EXPECT_EQ(all_groups(c, "dp_cp"), dp);
  EXPECT_EQ(all_groups(c, "mp"), mp);
  EXPECT_EQ(all_groups(c, "ep"), tp);
  EXPECT_EQ(all_groups(c, "tp_ep"), tp);
  EXPECT_EQ(all_groups(c, "expt_tp"), singletons(24));
  EXPECT_EQ(all_groups(c, "expt_dp"), dp);
  EXPECT_EQ(all_groups(c, "tp_ep_pp"), mp);
  EXPECT_EQ(expert_generator(c).get_ranks("pp"), pp);
  // rank 17 = 2 + 3*1 + 6*2: tp 2, pp 1, dp 2; expert: ep 2, pp 1, edp 2
  const ProcessGroupLayout l = layout_for_rank(c, 17);
  EXPECT_EQ(l.tp_rank, 2);
  EXPECT_EQ(l.pp_rank, 1);
  EXPECT_EQ(l.dp_rank, 2);
  EXPECT_EQ(l.ep_rank, 2);
  EXPECT_EQ(l.edp_rank, 2);
  EXPECT_EQ(l.pp, (std::vector<int64_t>{14, 17}));
  EXPECT_EQ(l.dp, (std::vector<int64_t>{5, 11, 17, 23}));
}

// 8 ranks, TP2 (DP4) / ETP1 EP4 (EDP2): EP folded over TP.
//   dense (2,1,1,4,1) strides (1,2,2,2,8): rank = tp + 2dp; expert (1,1,4,2,1): rank = ep + 4edp.
TEST(RankGenerator, EightRanksTp2Ep4Etp1) {
  ParallelConfig c;
  c.world = 8;
  c.tp = 2;
  c.ep = 4;
  c.etp = 1;
  ASSERT_EQ(c.dp(), 4);
  ASSERT_EQ(c.edp(), 2);
  EXPECT_EQ(to_string(all_groups(c, "tp")), "[0,1][2,3][4,5][6,7]");
  EXPECT_EQ(to_string(all_groups(c, "dp")), "[0,2,4,6][1,3,5,7]");
  EXPECT_EQ(to_string(all_groups(c, "pp")), "[0][1][2][3][4][5][6][7]");
  EXPECT_EQ(to_string(all_groups(c, "mp")), "[0,1][2,3][4,5][6,7]");
  EXPECT_EQ(to_string(all_groups(c, "ep")), "[0,1,2,3][4,5,6,7]");
  EXPECT_EQ(to_string(all_groups(c, "expt_tp")), "[0][1][2][3][4][5][6][7]");
  EXPECT_EQ(to_string(all_groups(c, "expt_dp")), "[0,4][1,5][2,6][3,7]");
  EXPECT_EQ(to_string(all_groups(c, "tp_ep")), "[0,1,2,3][4,5,6,7]");
  EXPECT_EQ(to_string(all_groups(c, "tp_ep_pp")), "[0,1,2,3][4,5,6,7]");
  // each EP group is two whole TP groups
  for (const auto& g : all_groups(c, "tp")) EXPECT_EQ(g[0] / 4, g[1] / 4);
  for (int64_t r = 0; r < 8; ++r) {
    const ProcessGroupLayout l = layout_for_rank(c, r);
    EXPECT_EQ(l.tp_rank, r % 2);
    EXPECT_EQ(l.dp_rank, r / 2);
    EXPECT_EQ(l.ep_rank, r % 4);
    EXPECT_EQ(l.edp_rank, r / 4);
    EXPECT_EQ(l.etp_rank, 0);
  }
}

TEST(RankGenerator, WorldOneGivesSingletons) {
  ParallelConfig c;  // world 1, all sizes 1
  EXPECT_EQ(c.dp(), 1);
  EXPECT_EQ(c.edp(), 1);
  for (const std::string& k : group_kinds()) EXPECT_EQ(all_groups(c, k), Groups{{0}}) << k;
  const ProcessGroupLayout l = layout_for_rank(c, 0);
  EXPECT_EQ(l.tp, std::vector<int64_t>{0});
  EXPECT_EQ(l.tp_ep_pp, std::vector<int64_t>{0});
  EXPECT_EQ(l.tp_rank + l.cp_rank + l.dp_rank + l.pp_rank + l.ep_rank + l.etp_rank + l.edp_rank, 0);
}

// Many layouts and orders: every kind partitions the world with the product size, and equals the
// coordinate-grouping reference; layout_for_rank agrees with all_groups for every rank.
TEST(RankGenerator, AllKindsMatchReferenceAndPartitionWorld) {
  std::vector<ParallelConfig> configs;
  const std::vector<std::string> orders = {"tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "pp-dp-ep-cp-tp", "dp-tp-ep-cp-pp",
                                           "cp-tp-dp-ep-pp"};
  for (const auto& order : orders)
    for (int64_t tp : {1, 2, 3})
      for (int64_t cp : {1, 2})
        for (int64_t pp : {1, 2})
          for (int64_t ep : {1, 2, 4})
            for (int64_t etp : {1, 2})
              for (int64_t world : {12, 16, 24, 48}) {
                ParallelConfig c;
                c.world = world;
                c.tp = tp;
                c.cp = cp;
                c.pp = pp;
                c.ep = ep;
                c.etp = etp;
                c.order = order;
                try {
                  validate(c, ModelDims{});
                } catch (const Error&) {
                  continue;  // invalid combination (checked by the error tests)
                }
                configs.push_back(c);
              }
  ASSERT_GT(configs.size(), 100u);
  for (const ParallelConfig& c : configs) {
    SCOPED_TRACE(::testing::Message() << "world " << c.world << " tp " << c.tp << " cp " << c.cp << " pp " << c.pp
                                      << " ep " << c.ep << " etp " << c.etp << " order " << c.order);
    std::map<std::string, Groups> groups;
    for (const KindRef& k : kKinds) {
      groups[k.kind] = all_groups(c, k.kind);
      EXPECT_EQ(groups[k.kind], reference_kind(c, k)) << k.kind;
      expect_partition(c, k.kind);
    }
    for (int64_t r = 0; r < c.world; r += 5) {
      const ProcessGroupLayout l = layout_for_rank(c, r);
      const std::map<std::string, const std::vector<int64_t>*> fields = {
          {"tp", &l.tp},     {"cp", &l.cp},       {"dp", &l.dp},           {"dp_cp", &l.dp_cp}, {"pp", &l.pp},
          {"tp_cp", &l.tp_cp}, {"tp_dp_cp", &l.tp_dp_cp}, {"mp", &l.mp},   {"ep", &l.ep},
          {"expt_tp", &l.expt_tp}, {"expt_dp", &l.expt_dp}, {"tp_ep", &l.tp_ep}, {"tp_ep_pp", &l.tp_ep_pp}};
      for (const auto& [kind, field] : fields) {
        const auto& all = groups[kind];
        auto it = std::find_if(all.begin(), all.end(),
                               [&](const auto& g) { return std::find(g.begin(), g.end(), r) != g.end(); });
        ASSERT_NE(it, all.end());
        EXPECT_EQ(*field, *it) << kind << " rank " << r;
      }
      auto pos = [&](const std::vector<int64_t>& g) { return std::find(g.begin(), g.end(), r) - g.begin(); };
      EXPECT_EQ(l.tp_rank, pos(l.tp));
      EXPECT_EQ(l.cp_rank, pos(l.cp));
      EXPECT_EQ(l.dp_rank, pos(l.dp));
      EXPECT_EQ(l.pp_rank, pos(l.pp));
      EXPECT_EQ(l.ep_rank, pos(l.ep));
      EXPECT_EQ(l.etp_rank, pos(l.expt_tp));
      EXPECT_EQ(l.edp_rank, pos(l.expt_dp));
    }
  }
}

// The generator on its own: strides are prefix products along the order (left-most fastest),
// a mask's names may come in any order, size-1 names may be left out, rank_offset shifts ranks.
TEST(RankGenerator, GeneratorStridesOffsetAndOmittedNames) {
  const RankGenerator g(/*tp=*/2, /*ep=*/1, /*dp=*/3, /*pp=*/4, /*cp=*/1, "pp-dp-tp");
  EXPECT_EQ(g.order(), "pp-dp-tp-ep-cp");
  EXPECT_EQ(g.world_size(), 24);
  EXPECT_EQ(g.strides(), (std::vector<int64_t>{1, 4, 12, 24, 24}));
  // pp fastest: pp groups are consecutive ranks, tp groups stride 12
  EXPECT_EQ(g.get_ranks("pp")[0], (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(g.get_ranks("pp")[5], (std::vector<int64_t>{20, 21, 22, 23}));
  EXPECT_EQ(g.get_ranks("tp")[0], (std::vector<int64_t>{0, 12}));
  EXPECT_EQ(g.get_ranks("dp")[1], (std::vector<int64_t>{1, 5, 9}));
  EXPECT_EQ(g.get_ranks("tp-dp"), g.get_ranks("dp-tp"));
  EXPECT_EQ(g.get_ranks("tp-dp")[2], (std::vector<int64_t>{2, 6, 10, 14, 18, 22}));
  EXPECT_EQ(g.coordinate("dp", 22), 2);
  EXPECT_EQ(g.coordinate("tp", 22), 1);
  EXPECT_EQ(g.group_containing("dp-tp", 22), g.get_ranks("tp-dp")[2]);
  const RankGenerator off(2, 1, 3, 4, 1, "PP-DP-TP", /*rank_offset=*/100);
  EXPECT_EQ(off.get_ranks("tp")[0], (std::vector<int64_t>{100, 112}));
  EXPECT_EQ(off.group_containing("tp", 113), (std::vector<int64_t>{101, 113}));
  EXPECT_THROW(off.group_containing("tp", 99), Error);
  EXPECT_THROW(g.get_ranks("tp-xx"), Error);
  EXPECT_THROW(g.get_ranks("tp-tp"), Error);
  EXPECT_THROW(RankGenerator(2, 1, 3, 4, 1, "pp-tp"), Error);          // dp = 3 not named
  EXPECT_THROW(RankGenerator(1, 2, 1, 1, 2, "tp-cp-ep-dp-pp"), Error); // ep and cp both > 1
  EXPECT_THROW(RankGenerator(1, 1, 1, 1, 1, "tp-tp"), Error);
  EXPECT_THROW(RankGenerator(0, 1, 1, 1, 1, "tp"), Error);
}

TEST(ParallelConfig, ValidateAcceptsGoodLayouts) {
  ModelDims d;
  d.num_layers = 8;
  d.heads = 8;
  d.query_groups = 2;
  d.experts = 8;
  d.expert_ffn = 64;
  ParallelConfig c = config16();
  c.vpp = 2;
  EXPECT_NO_THROW(validate(c, d));
  c.order = "tp-cp-dp-pp";  // ep = 4 > 1 must be named
  EXPECT_THROW(validate(c, d), Error);
  ParallelConfig small;
  small.world = 4;
  small.tp = 4;
  small.etp = 4;
  small.order = "tp";  // every other size is 1: may be left out, as in Megatron
  EXPECT_NO_THROW(validate(small, ModelDims{}));
  small.order = "tp-pp";  // ...but a size > 1 may not
  small.tp = 2;  // dp = 2
  EXPECT_NE(error_of(small, ModelDims{}).find("does not name 'dp'"), std::string::npos);
}

TEST(ParallelConfig, ValidateErrorsNameTheFlags) {
  // Exact messages for two cases.
  ParallelConfig c;
  c.world = 12;
  c.tp = 4;
  c.pp = 2;
  EXPECT_EQ(error_of(c, ModelDims{}),
            "world size 12 is not divisible by --tensor-model-parallel-size (4) x --context-parallel-size (1) x "
            "--pipeline-model-parallel-size (2) = 8; expected a world size that is a multiple of 8");
  ParallelConfig e = config16();
  ModelDims d;
  d.experts = 6;
  EXPECT_EQ(error_of(e, d),
            "--num-experts (6) is not divisible by --expert-model-parallel-size (4); expected a number of experts "
            "that is a multiple of the expert-parallel size");

  auto contains = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos;
  };
  {
    ParallelConfig x = config16();
    x.ep = 3;  // 1 * 3 * 2 = 6 does not divide 16
    const std::string m = error_of(x, ModelDims{});
    EXPECT_TRUE(contains(m, "--expert-tensor-parallel-size (1) x --expert-model-parallel-size (3)")) << m;
  }
  {
    ParallelConfig x = config16();
    x.cp = 0;
    EXPECT_EQ(error_of(x, ModelDims{}), "--context-parallel-size must be >= 1, got 0");
  }
  {
    ModelDims h;
    h.heads = 6;
    const std::string m = error_of(config16(), h);  // tp 2 divides 6: fine; with tp 4 it does not
    EXPECT_EQ(m, "(no error)");
    ParallelConfig x = config16();
    x.tp = 4;
    x.cp = 1;
    h.heads = 6;
    EXPECT_TRUE(contains(error_of(x, h), "--num-attention-heads (6) is not divisible by --tensor-model-parallel-size (4)"));
    h.heads = 8;
    h.query_groups = 2;
    EXPECT_TRUE(contains(error_of(x, h), "--num-query-groups (2) is not divisible by --tensor-model-parallel-size (4)"));
  }
  {
    ParallelConfig x = config16();
    x.vpp = 3;
    ModelDims l;
    l.num_layers = 8;  // 8 % (2*3) != 0
    const std::string m = error_of(x, l);
    EXPECT_TRUE(contains(m, "--num-layers (8)") && contains(m, "--pipeline-model-parallel-size (2)") &&
                contains(m, "--num-layers-per-virtual-pipeline-stage") && contains(m, "= 6"))
        << m;
    ParallelConfig y;
    y.world = 2;
    y.tp = 2;
    y.vpp = 2;  // interleaving needs pp > 1
    EXPECT_TRUE(contains(error_of(y, ModelDims{}), "needs --pipeline-model-parallel-size > 1")) << error_of(y, {});
  }
  {
    ParallelConfig x = config16();
    x.etp = 2;
    x.ep = 2;
    ModelDims f;
    f.expert_ffn = 63;
    EXPECT_TRUE(contains(error_of(x, f), "--moe-ffn-hidden-size (63) is not divisible by --expert-tensor-parallel-size (2)"));
  }
  {
    ParallelConfig x = config16();
    x.order = "tp-cp-dp-pp";  // ep 4 not named
    const std::string m = error_of(x, ModelDims{});
    EXPECT_TRUE(contains(m, "does not name 'ep'") && contains(m, "--expert-model-parallel-size is 4")) << m;
    x.order = "tp-cp-ep-dp-pp-tp";
    EXPECT_TRUE(contains(error_of(x, ModelDims{}), "names 'tp' twice"));
    x.order = "tp-cp-ep-dp-xp";
    EXPECT_TRUE(contains(error_of(x, ModelDims{}), "unknown name 'xp'"));
  }
  EXPECT_THROW(all_groups(config16(), "nope"), Error);
  EXPECT_THROW(layout_for_rank(config16(), 16), Error);
}

// Megatron's two consistency rules between the dense and the expert generator.
TEST(ParallelConfig, DenseAndExpertPipelineGroupsMustAgree) {
  // pp not last and EDP != DP: Megatron's "When not using pp-last rank ordering" rule.
  ParallelConfig a;
  a.world = 16;
  a.tp = 2;
  a.pp = 2;  // dp 4
  a.ep = 4;  // edp 2
  a.order = "tp-cp-ep-pp-dp";
  const std::string ma = error_of(a, ModelDims{});
  EXPECT_TRUE(ma.find("does not end with pp") != std::string::npos &&
              ma.find("expert data-parallel size") != std::string::npos)
      << ma;
  // EDP == DP, but pp comes right after tp, whose size differs (TP2 vs ETP1): dense pp groups
  // have stride 2 ([0,2],[1,3],...), expert ones stride 1 ([0,1],[2,3],...).
  ParallelConfig b;
  b.world = 8;
  b.tp = 2;
  b.pp = 2;  // dp 2
  b.ep = 2;
  b.etp = 1;  // edp 2
  b.order = "tp-pp-cp-ep-dp";
  EXPECT_EQ(to_string(dense_generator(b).get_ranks("pp")), "[0,2][1,3][4,6][5,7]");
  EXPECT_EQ(to_string(expert_generator(b).get_ranks("pp")), "[0,1][2,3][4,5][6,7]");
  const std::string mb = error_of(b, ModelDims{});
  EXPECT_TRUE(mb.find("different pipeline groups") != std::string::npos &&
              mb.find("[0,2] vs [0,1]") != std::string::npos && mb.find("--pipeline-model-parallel-size") != std::string::npos)
      << mb;
}
