// Megatron-Core's RankGenerator and the process-group enumeration with Parallel Folding.
// Pure functions: no communication (the communicators are built from these lists).
//
// A generator has five sizes, laid out along the order string (left-most fastest):
//   names   = order tokens, e.g. [tp, cp, ep, dp, pp]; sizes s_i; strides d_i = s_0*...*s_{i-1}
//   rank    = rank_offset + sum_i coord_i * d_i,  coord_i = (rank - offset) / d_i % s_i
// get_ranks(mask), mask = some names joined by '-' (their order in the mask does not matter):
//   masked dims M (in order-string order), unmasked dims U
//   group size = prod_{i in M} s_i; number of groups = world / group size
//   group g, member j: g decomposed over sizes of U (mixed radix, first fastest) -> g_idx,
//                      j decomposed over sizes of M                              -> j_idx,
//   rank = offset + <j_idx, strides of M> + <g_idx, strides of U>
// So members are in increasing rank order and groups in increasing order of their first rank.
//
// Parallel Folding (decoder only, no encoder offset): two generators share the order string,
//   dense:  tp=TP,  cp=CP, ep=1,  dp=DP,  pp=PP
//   expert: tp=ETP, cp=1,  ep=EP, dp=EDP, pp=PP
// and must give the same pp groups (validate() checks it).
//
// Group kinds (ProcessGroupLayout fields, all_groups kinds) and their generator masks:
//   tp "tp", cp "cp", dp "dp", dp_cp "dp-cp", pp "pp", tp_cp "tp-cp", tp_dp_cp "tp-dp-cp",
//   mp "tp-pp"                                                       (dense generator)
//   ep "ep", expt_tp "tp", expt_dp "dp", tp_ep "tp-ep", tp_ep_pp "tp-ep-pp" (expert generator)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moecore/parallel/parallel_config.h"

namespace moecore::parallel {

class RankGenerator {
 public:
  // Raises an Error for a size < 1, ep > 1 together with cp > 1 (Megatron keeps CP in the dense
  // generator and EP in the expert one), an unknown or repeated name in `order`, or a name of
  // size > 1 missing from it. Names of size 1 missing from the order are appended.
  RankGenerator(int64_t tp, int64_t ep, int64_t dp, int64_t pp, int64_t cp, const std::string& order,
                int64_t rank_offset = 0);

  // All groups for a mask such as "tp", "tp-pp", "tp-ep" (global ranks).
  std::vector<std::vector<int64_t>> get_ranks(const std::string& token) const;
  // The one group of get_ranks(token) that holds `rank` (global), computed directly.
  std::vector<int64_t> group_containing(const std::string& token, int64_t rank) const;
  // The rank's coordinate along one dimension ("tp", "cp", "ep", "dp" or "pp").
  int64_t coordinate(const std::string& name, int64_t rank) const;

  int64_t world_size() const { return world_; }
  const std::string& order() const { return order_; }  // completed order, lower case
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<int64_t>& sizes() const { return sizes_; }
  const std::vector<int64_t>& strides() const { return strides_; }

 private:
  std::vector<bool> mask_of(const std::string& token) const;
  int64_t index_of(const std::string& name) const;
  int64_t local_rank(int64_t rank) const;  // rank - offset, checked

  int64_t world_ = 1, offset_ = 0;
  std::string order_;
  std::vector<std::string> names_;
  std::vector<int64_t> sizes_, strides_;
};

// The dense and the expert generator of a config (after validate(c, ModelDims{})).
RankGenerator dense_generator(const ParallelConfig& c);
RankGenerator expert_generator(const ParallelConfig& c);

struct ProcessGroupLayout {
  // groups this rank belongs to, as lists of global ranks (sorted as the generator returns them)
  std::vector<int64_t> tp, cp, dp, dp_cp, pp, tp_cp, tp_dp_cp, mp /*tp-pp*/, ep, expt_tp, expt_dp,
      tp_ep /*expert tp-ep*/, tp_ep_pp;
  // this rank's coordinates (= its index in the tp, cp, dp, pp, ep, expt_tp, expt_dp group)
  int64_t tp_rank = 0, cp_rank = 0, dp_rank = 0, pp_rank = 0, ep_rank = 0, etp_rank = 0, edp_rank = 0;
};

// Validates the layout (ModelDims unknown), then the groups of `rank` (0 <= rank < world).
ProcessGroupLayout layout_for_rank(const ParallelConfig& c, int64_t rank);

// All groups of a kind (a ProcessGroupLayout field name: "tp", "cp", ..., "tp_ep_pp").
std::vector<std::vector<int64_t>> all_groups(const ParallelConfig& c, const std::string& kind);

// The kind names, in ProcessGroupLayout order.
const std::vector<std::string>& group_kinds();

}  // namespace moecore::parallel
