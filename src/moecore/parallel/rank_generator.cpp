#include "moecore/parallel/rank_generator.h"

#include <algorithm>
#include <cctype>

#include "moecore/core/error.h"

namespace moecore::parallel {

namespace {

std::vector<std::string> split_dashes(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s) {
    if (ch == '-') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
    }
  }
  out.push_back(cur);
  return out;
}

std::string join_dashes(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) s += "-";
    s += names[i];
  }
  return s;
}

// Mixed-radix decomposition of `index` over `shape`, first digit fastest.
std::vector<int64_t> decompose(int64_t index, const std::vector<int64_t>& shape) {
  std::vector<int64_t> idx(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    idx[i] = index % shape[i];
    index /= shape[i];
  }
  return idx;
}

int64_t inner(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  int64_t s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

RankGenerator::RankGenerator(int64_t tp, int64_t ep, int64_t dp, int64_t pp, int64_t cp,
                             const std::string& order, int64_t rank_offset)
    : offset_(rank_offset) {
  const std::vector<std::string> known = {"tp", "pp", "dp", "ep", "cp"};
  const std::vector<int64_t> known_sizes = {tp, pp, dp, ep, cp};
  for (size_t i = 0; i < known.size(); ++i)
    MC_CHECK(known_sizes[i] >= 1, "RankGenerator: size of ", known[i], " must be >= 1, got ", known_sizes[i]);
  MC_CHECK(rank_offset >= 0, "RankGenerator: rank_offset must be >= 0, got ", rank_offset);
  MC_CHECK(ep == 1 || cp == 1, "RankGenerator: ep (", ep, ") and cp (", cp,
           ") are both > 1; expected CP only in the dense generator and EP only in the expert generator");

  names_ = split_dashes(order);
  for (size_t i = 0; i < names_.size(); ++i) {
    MC_CHECK(std::find(known.begin(), known.end(), names_[i]) != known.end(), "RankGenerator: order '", order,
             "' has unknown name '", names_[i], "'; expected names from tp, cp, ep, dp, pp joined by '-'");
    MC_CHECK(std::find(names_.begin(), names_.begin() + i, names_[i]) == names_.begin() + i,
             "RankGenerator: order '", order, "' names '", names_[i], "' twice; expected each name at most once");
  }
  for (size_t i = 0; i < known.size(); ++i) {
    if (std::find(names_.begin(), names_.end(), known[i]) != names_.end()) continue;
    MC_CHECK(known_sizes[i] == 1, "RankGenerator: the size of ", known[i], " is ", known_sizes[i],
             ", but the order '", order, "' does not name it; expected every dimension of size > 1 in the order");
    names_.push_back(known[i]);  // size 1: its place does not matter (Megatron appends it)
  }
  order_ = join_dashes(names_);
  int64_t stride = 1;
  for (const std::string& n : names_) {
    const int64_t s = known_sizes[std::find(known.begin(), known.end(), n) - known.begin()];
    sizes_.push_back(s);
    strides_.push_back(stride);
    stride *= s;
  }
  world_ = stride;
}

int64_t RankGenerator::index_of(const std::string& name) const {
  auto it = std::find(names_.begin(), names_.end(), name);
  MC_CHECK(it != names_.end(), "RankGenerator: unknown dimension '", name, "' in a group mask; expected one of ",
           order_);
  return it - names_.begin();
}

std::vector<bool> RankGenerator::mask_of(const std::string& token) const {
  std::vector<bool> mask(names_.size(), false);
  for (const std::string& t : split_dashes(token)) {
    const int64_t i = index_of(t);
    MC_CHECK(!mask[i], "RankGenerator: group mask '", token, "' names '", t, "' twice");
    mask[i] = true;
  }
  return mask;
}

int64_t RankGenerator::local_rank(int64_t rank) const {
  MC_CHECK(rank >= offset_ && rank < offset_ + world_, "RankGenerator: rank ", rank, " is outside [", offset_,
           ", ", offset_ + world_, ")");
  return rank - offset_;
}

std::vector<std::vector<int64_t>> RankGenerator::get_ranks(const std::string& token) const {
  const std::vector<bool> mask = mask_of(token);
  std::vector<int64_t> m_shape, m_stride, u_shape, u_stride;
  for (size_t i = 0; i < names_.size(); ++i) {
    (mask[i] ? m_shape : u_shape).push_back(sizes_[i]);
    (mask[i] ? m_stride : u_stride).push_back(strides_[i]);
  }
  int64_t group_size = 1;
  for (int64_t s : m_shape) group_size *= s;
  const int64_t num_groups = world_ / group_size;
  std::vector<std::vector<int64_t>> groups(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t base = inner(decompose(g, u_shape), u_stride);
    groups[g].reserve(group_size);
    for (int64_t j = 0; j < group_size; ++j)
      groups[g].push_back(offset_ + base + inner(decompose(j, m_shape), m_stride));
  }
  return groups;
}

std::vector<int64_t> RankGenerator::group_containing(const std::string& token, int64_t rank) const {
  const std::vector<bool> mask = mask_of(token);
  const int64_t r = local_rank(rank);
  // Keep the rank's unmasked coordinates; enumerate the masked ones, first fastest.
  int64_t base = 0;
  std::vector<int64_t> m_shape, m_stride;
  for (size_t i = 0; i < names_.size(); ++i) {
    if (mask[i]) {
      m_shape.push_back(sizes_[i]);
      m_stride.push_back(strides_[i]);
    } else {
      base += (r / strides_[i]) % sizes_[i] * strides_[i];
    }
  }
  int64_t group_size = 1;
  for (int64_t s : m_shape) group_size *= s;
  std::vector<int64_t> group;
  group.reserve(group_size);
  for (int64_t j = 0; j < group_size; ++j) group.push_back(offset_ + base + inner(decompose(j, m_shape), m_stride));
  return group;
}

int64_t RankGenerator::coordinate(const std::string& name, int64_t rank) const {
  const int64_t i = index_of(name);
  return (local_rank(rank) / strides_[i]) % sizes_[i];
}

RankGenerator dense_generator(const ParallelConfig& c) {
  return RankGenerator(c.tp, 1, c.dp(), c.pp, c.cp, c.order);
}

RankGenerator expert_generator(const ParallelConfig& c) {
  return RankGenerator(c.etp, c.ep, c.edp(), c.pp, 1, c.order);
}

namespace {

struct KindSpec {
  const char* kind;
  bool expert;
  const char* mask;
  std::vector<int64_t> ProcessGroupLayout::*field;
};

const std::vector<KindSpec>& kind_specs() {
  static const std::vector<KindSpec> specs = {
      {"tp", false, "tp", &ProcessGroupLayout::tp},
      {"cp", false, "cp", &ProcessGroupLayout::cp},
      {"dp", false, "dp", &ProcessGroupLayout::dp},
      {"dp_cp", false, "dp-cp", &ProcessGroupLayout::dp_cp},
      {"pp", false, "pp", &ProcessGroupLayout::pp},
      {"tp_cp", false, "tp-cp", &ProcessGroupLayout::tp_cp},
      {"tp_dp_cp", false, "tp-dp-cp", &ProcessGroupLayout::tp_dp_cp},
      {"mp", false, "tp-pp", &ProcessGroupLayout::mp},
      {"ep", true, "ep", &ProcessGroupLayout::ep},
      {"expt_tp", true, "tp", &ProcessGroupLayout::expt_tp},
      {"expt_dp", true, "dp", &ProcessGroupLayout::expt_dp},
      {"tp_ep", true, "tp-ep", &ProcessGroupLayout::tp_ep},
      {"tp_ep_pp", true, "tp-ep-pp", &ProcessGroupLayout::tp_ep_pp},
  };
  return specs;
}

}  // namespace

const std::vector<std::string>& group_kinds() {
  static const std::vector<std::string> kinds = [] {
    std::vector<std::string> k;
    for (const KindSpec& s : kind_specs()) k.push_back(s.kind);
    return k;
  }();
  return kinds;
}

ProcessGroupLayout layout_for_rank(const ParallelConfig& c, int64_t rank) {
  validate(c, ModelDims{});
  MC_CHECK(rank >= 0 && rank < c.world, "layout_for_rank: rank ", rank, " is outside the world [0, ", c.world, ")");
  const RankGenerator dense = dense_generator(c), expert = expert_generator(c);
  ProcessGroupLayout l;
  for (const KindSpec& s : kind_specs()) l.*s.field = (s.expert ? expert : dense).group_containing(s.mask, rank);
  l.tp_rank = dense.coordinate("tp", rank);
  l.cp_rank = dense.coordinate("cp", rank);
  l.dp_rank = dense.coordinate("dp", rank);
  l.pp_rank = dense.coordinate("pp", rank);
  l.ep_rank = expert.coordinate("ep", rank);
  l.etp_rank = expert.coordinate("tp", rank);
  l.edp_rank = expert.coordinate("dp", rank);
  return l;
}

std::vector<std::vector<int64_t>> all_groups(const ParallelConfig& c, const std::string& kind) {
  for (const KindSpec& s : kind_specs()) {
    if (kind != s.kind) continue;
    validate(c, ModelDims{});
    return (s.expert ? expert_generator(c) : dense_generator(c)).get_ranks(s.mask);
  }
  std::string list;
  for (const std::string& k : group_kinds()) {
    if (!list.empty()) list += ", ";
    list += k;
  }
  MC_FAIL("all_groups: unknown group kind '", kind, "'; expected one of ", list);
}

}  // namespace moecore::parallel
