#include "moecore/parallel/parallel_config.h"

#include <algorithm>
#include <cctype>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/parallel/rank_generator.h"

namespace moecore::parallel {

int64_t ParallelConfig::dp() const {
  const int64_t m = tp * cp * pp;
  return m > 0 ? world / m : 0;
}

int64_t ParallelConfig::edp() const {
  const int64_t m = etp * ep * pp;
  return m > 0 ? world / m : 0;
}

namespace {

constexpr const char* kTp = "--tensor-model-parallel-size";
constexpr const char* kCp = "--context-parallel-size";
constexpr const char* kPp = "--pipeline-model-parallel-size";
constexpr const char* kEp = "--expert-model-parallel-size";
constexpr const char* kEtp = "--expert-tensor-parallel-size";
constexpr const char* kVpp = "--num-virtual-stages-per-pipeline-rank (or --num-layers-per-virtual-pipeline-stage)";

std::string group_str(const std::vector<int64_t>& g) {
  std::string s = "[";
  for (size_t i = 0; i < g.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(g[i]);
  }
  return s + "]";
}

// The order string, with the flags behind each name (tokens lower-cased as Megatron does).
void check_order(const ParallelConfig& c) {
  std::vector<std::string> names;
  std::string cur;
  for (char ch : c.order + "-") {
    if (ch != '-') {
      cur.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
      continue;
    }
    MC_CHECK(cur == "tp" || cur == "cp" || cur == "ep" || cur == "dp" || cur == "pp", "parallel order '", c.order,
             "' has unknown name '", cur, "'; expected tp, cp, ep, dp, pp joined by '-' (default tp-cp-ep-dp-pp)");
    MC_CHECK(std::find(names.begin(), names.end(), cur) == names.end(), "parallel order '", c.order, "' names '",
             cur, "' twice; expected each of tp, cp, ep, dp, pp at most once");
    names.push_back(cur);
    cur.clear();
  }
  struct Need {
    const char* name;
    bool needed;
    std::string why;
  };
  const Need needs[] = {
      {"tp", c.tp > 1 || c.etp > 1,
       detail::concat(kTp, " is ", c.tp, " and ", kEtp, " is ", c.etp)},
      {"cp", c.cp > 1, detail::concat(kCp, " is ", c.cp)},
      {"ep", c.ep > 1, detail::concat(kEp, " is ", c.ep)},
      {"dp", c.dp() > 1 || c.edp() > 1,
       detail::concat("the data-parallel size is ", c.dp(), " and the expert data-parallel size is ", c.edp())},
      {"pp", c.pp > 1, detail::concat(kPp, " is ", c.pp)},
  };
  for (const Need& n : needs)
    MC_CHECK(!n.needed || std::find(names.begin(), names.end(), n.name) != names.end(), "parallel order '",
             c.order, "' does not name '", n.name, "', but ", n.why,
             "; expected every dimension of size > 1 in the order (default tp-cp-ep-dp-pp)");
}

}  // namespace

void validate(const ParallelConfig& c, const ModelDims& dims) {
  MC_CHECK(c.world >= 1, "parallel layout: the world size must be >= 1, got ", c.world);
  const std::pair<const char*, int64_t> sizes[] = {{kTp, c.tp}, {kCp, c.cp}, {kPp, c.pp},
                                                   {kVpp, c.vpp}, {kEp, c.ep}, {kEtp, c.etp}};
  for (const auto& [flag, v] : sizes) MC_CHECK(v >= 1, flag, " must be >= 1, got ", v);

  const int64_t dense = c.tp * c.cp * c.pp, expert = c.etp * c.ep * c.pp;
  MC_CHECK(c.world % dense == 0, "world size ", c.world, " is not divisible by ", kTp, " (", c.tp, ") x ", kCp, " (",
           c.cp, ") x ", kPp, " (", c.pp, ") = ", dense, "; expected a world size that is a multiple of ", dense);
  MC_CHECK(c.world % expert == 0, "world size ", c.world, " is not divisible by ", kEtp, " (", c.etp, ") x ", kEp,
           " (", c.ep, ") x ", kPp, " (", c.pp, ") = ", expert, "; expected a world size that is a multiple of ",
           expert);
  MC_CHECK(c.vpp == 1 || c.pp > 1, "a virtual pipeline (", kVpp, ": ", c.vpp, " stages per rank) needs ", kPp,
           " > 1, got ", c.pp);

  check_order(c);
  std::string order = c.order;
  for (char& ch : order) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const bool pp_last = order.size() >= 2 && order.compare(order.size() - 2, 2, "pp") == 0;
  MC_CHECK(pp_last || c.pp == 1 || c.edp() == c.dp(), "parallel order '", c.order, "' does not end with pp and ",
           kPp, " is ", c.pp, ", so the expert data-parallel size (world / (", kEtp, " x ", kEp, " x ", kPp, ") = ",
           c.edp(), ") must equal the data-parallel size (world / (", kTp, " x ", kCp, " x ", kPp, ") = ", c.dp(),
           "); expected pp last in the order or equal data-parallel sizes");

  const auto dense_pp = dense_generator(c).get_ranks("pp");
  const auto expert_pp = expert_generator(c).get_ranks("pp");
  for (size_t g = 0; g < dense_pp.size(); ++g)
    MC_CHECK(dense_pp[g] == expert_pp[g], "parallel order '", c.order,
             "' gives different pipeline groups to the dense generator (", kTp, " ", c.tp, ", ", kCp, " ", c.cp,
             ") and the expert generator (", kEtp, " ", c.etp, ", ", kEp, " ", c.ep, "): group ", g, " is ",
             group_str(dense_pp[g]), " vs ", group_str(expert_pp[g]),
             "; expected identical ", kPp, " groups (put pp last in the order)");

  const std::pair<const char*, int64_t> dim_list[] = {{"--num-layers", dims.num_layers},
                                                      {"--num-attention-heads", dims.heads},
                                                      {"--num-query-groups", dims.query_groups},
                                                      {"--num-experts", dims.experts},
                                                      {"--moe-ffn-hidden-size", dims.expert_ffn}};
  for (const auto& [flag, v] : dim_list) MC_CHECK(v >= 0, flag, " must be >= 1 (0: not checked), got ", v);
  // 0 means "unknown here": not checked.
  MC_CHECK(dims.heads % c.tp == 0, "--num-attention-heads (", dims.heads, ") is not divisible by ", kTp, " (", c.tp,
           "); expected a number of heads that is a multiple of the tensor-parallel size");
  MC_CHECK(dims.query_groups % c.tp == 0, "--num-query-groups (", dims.query_groups, ") is not divisible by ", kTp,
           " (", c.tp, "); expected a number of query groups that is a multiple of the tensor-parallel size");
  MC_CHECK(dims.experts % c.ep == 0, "--num-experts (", dims.experts, ") is not divisible by ", kEp, " (", c.ep,
           "); expected a number of experts that is a multiple of the expert-parallel size");
  MC_CHECK(dims.num_layers % (c.pp * c.vpp) == 0, "--num-layers (", dims.num_layers, ") is not divisible by ", kPp,
           " (", c.pp, ") x virtual stages per pipeline rank (", c.vpp, ", ", kVpp, ") = ", c.pp * c.vpp,
           "; expected a number of layers that is a multiple of ", c.pp * c.vpp);
  MC_CHECK(dims.expert_ffn % c.etp == 0, "--moe-ffn-hidden-size (", dims.expert_ffn, ") is not divisible by ", kEtp,
           " (", c.etp, "); expected an expert FFN size that is a multiple of the expert tensor-parallel size");
}

}  // namespace moecore::parallel
