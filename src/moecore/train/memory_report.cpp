#include "moecore/train/memory_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

namespace moecore {

namespace {
constexpr double kGB = 1e9;
// The gathered layout of one rank: rank, each tag's bytes, rounding, allocated, reserved, the
// allocator's peak reserved and peak allocated, the offloaded activations' host peak and its
// modules, then the optimizer offload's three host parts (from kHostParts).
constexpr size_t kFields = 1 + kNumMemoryTags + 5 + 1 + kNumOffloadModules + 3;
constexpr size_t kHostParts = 6 + kNumOffloadModules;

// The report's rows in order: the categories, activations followed by their modules.
const MemoryCategory kCategoryOrder[] = {MemoryCategory::kWeights,       MemoryCategory::kGradients,
                                         MemoryCategory::kOptimizerState, MemoryCategory::kActivations,
                                         MemoryCategory::kCommunication, MemoryCategory::kWorkspace,
                                         MemoryCategory::kUntagged};

// Activation modules with bytes at the peak, largest first.
std::vector<std::pair<MemoryTag, int64_t>> activation_rows(const RankMemoryReport& r) {
  std::vector<std::pair<MemoryTag, int64_t>> rows;
  for (int t = 0; t < kNumMemoryTags; ++t) {
    const MemoryTag tag = static_cast<MemoryTag>(t);
    if (memory_tag_category(tag) == MemoryCategory::kActivations && r.at_peak.by_tag[tag] != 0)
      rows.emplace_back(tag, r.at_peak.by_tag[tag]);
  }
  std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  return rows;
}

double share(int64_t part, int64_t whole) { return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0; }
}  // namespace

int64_t RankMemoryReport::category_bytes(MemoryCategory c) const {
  int64_t s = 0;
  for (int t = 0; t < kNumMemoryTags; ++t)
    if (memory_tag_category(static_cast<MemoryTag>(t)) == c) s += at_peak.by_tag[static_cast<size_t>(t)];
  return s;
}

RankMemoryReport local_memory_report(const CachingAllocator& allocator, int64_t rank) {
  RankMemoryReport r;
  r.rank = rank;
  r.at_peak = allocator.breakdown_at_peak();  // before the stats: a later allocation only raises them
  const AllocatorStats s = allocator.stats();
  r.peak_reserved = s.peak_reserved_bytes;
  r.peak_allocated = s.peak_allocated_bytes;
  r.host_offloaded = offload_host_usage();
  const MemoryBreakdown host = pinned_allocator().breakdown_now();
  auto host_bytes = [&](MemoryCategory c) { return host.by_tag[memory_tag(c)]; };
  r.host_weights = host_bytes(MemoryCategory::kWeights);
  r.host_gradients = host_bytes(MemoryCategory::kGradients);
  r.host_optimizer_state = host_bytes(MemoryCategory::kOptimizerState);
  return r;
}

std::vector<RankMemoryReport> gather_memory_reports(comm::Communicator* world, const RankMemoryReport& mine,
                                                    int64_t world_size) {
  if (!world) return {mine};
  std::vector<double> all(kFields * static_cast<size_t>(world_size), 0.0);
  double* f = all.data() + kFields * static_cast<size_t>(mine.rank);
  f[0] = static_cast<double>(mine.rank);
  for (int t = 0; t < kNumMemoryTags; ++t) f[1 + t] = static_cast<double>(mine.at_peak.by_tag[static_cast<size_t>(t)]);
  double* tail = f + 1 + kNumMemoryTags;
  tail[0] = static_cast<double>(mine.at_peak.rounding);
  tail[1] = static_cast<double>(mine.at_peak.allocated);
  tail[2] = static_cast<double>(mine.at_peak.reserved);
  tail[3] = static_cast<double>(mine.peak_reserved);
  tail[4] = static_cast<double>(mine.peak_allocated);
  tail[5] = static_cast<double>(mine.host_offloaded.peak);
  for (int m = 0; m < kNumOffloadModules; ++m) tail[6 + m] = static_cast<double>(mine.host_offloaded.at_peak[static_cast<size_t>(m)]);
  tail[kHostParts] = static_cast<double>(mine.host_weights);
  tail[kHostParts + 1] = static_cast<double>(mine.host_gradients);
  tail[kHostParts + 2] = static_cast<double>(mine.host_optimizer_state);
  comm::all_reduce_host(*world, all);
  std::vector<RankMemoryReport> out(static_cast<size_t>(world_size));
  for (size_t r = 0; r < out.size(); ++r) {
    const double* g = all.data() + kFields * r;
    auto i64 = [](double v) { return static_cast<int64_t>(std::llround(v)); };
    RankMemoryReport& o = out[r];
    o.rank = i64(g[0]);
    for (int t = 0; t < kNumMemoryTags; ++t) o.at_peak.by_tag[static_cast<size_t>(t)] = i64(g[1 + t]);
    const double* gt = g + 1 + kNumMemoryTags;
    o.at_peak.rounding = i64(gt[0]);
    o.at_peak.allocated = i64(gt[1]);
    o.at_peak.reserved = i64(gt[2]);
    o.peak_reserved = i64(gt[3]);
    o.peak_allocated = i64(gt[4]);
    o.host_offloaded.peak = i64(gt[5]);
    for (int m = 0; m < kNumOffloadModules; ++m) o.host_offloaded.at_peak[static_cast<size_t>(m)] = i64(gt[6 + m]);
    o.host_weights = i64(gt[kHostParts]);
    o.host_gradients = i64(gt[kHostParts + 1]);
    o.host_optimizer_state = i64(gt[kHostParts + 2]);
  }
  return out;
}

std::string format_memory_report(const std::vector<RankMemoryReport>& ranks, int64_t iteration) {
  std::string s;
  char line[256];
  // GB; MB when every rank's peak is below 1 GB (small models).
  int64_t largest = 0;
  for (const RankMemoryReport& r : ranks) largest = std::max(largest, r.peak_reserved);
  const bool mb = largest < static_cast<int64_t>(kGB);
  const double unit = mb ? 1e6 : kGB;
  const char* unit_name = mb ? "MB" : "GB";
  std::snprintf(line, sizeof line, " memory report at iteration %lld (per rank; %s and %% of the rank's peak):\n",
                static_cast<long long>(iteration), unit_name);
  s += line;
  for (const RankMemoryReport& r : ranks) {
    const int64_t peak = r.peak_reserved;
    std::snprintf(line, sizeof line, "   rank %lld: peak %.4f %s reserved by the allocator (%.4f %s handed out)\n",
                  static_cast<long long>(r.rank), static_cast<double>(peak) / unit, unit_name,
                  static_cast<double>(r.peak_allocated) / unit, unit_name);
    s += line;
    auto row = [&](const char* name, int64_t bytes, int indent) {
      std::snprintf(line, sizeof line, "     %*s%-*s %10.4f %s %6.2f%%\n", indent, "", 22 - indent, name,
                    static_cast<double>(bytes) / unit, unit_name, share(bytes, peak));
      s += line;
    };
    for (MemoryCategory c : kCategoryOrder) {
      row(memory_category_name(c), r.category_bytes(c), 0);
      if (c == MemoryCategory::kActivations)
        for (const auto& [tag, bytes] : activation_rows(r)) row(memory_tag_name(tag), bytes, 2);
    }
    row("allocator_overhead", r.overhead(), 0);
    const double ratio = peak > 0 ? static_cast<double>(r.parts_sum()) / static_cast<double>(peak) : 1.0;
    std::snprintf(line, sizeof line, "     check: the parts sum to %.4f %s, %.2f%% of the measured peak %.4f %s (%s)\n",
                  static_cast<double>(r.parts_sum()) / unit, unit_name, 100.0 * ratio, static_cast<double>(peak) / unit,
                  unit_name, std::fabs(ratio - 1.0) <= 0.03 ? "within 3%" : "OFF BY MORE THAN 3%");
    s += line;
    if (r.host_offloaded.peak > 0) {
      std::string modules;
      for (int m = 0; m < kNumOffloadModules; ++m) {
        const int64_t b = r.host_offloaded.at_peak[static_cast<size_t>(m)];
        if (b == 0) continue;
        std::snprintf(line, sizeof line, "%s%s %.4f", modules.empty() ? "" : ", ",
                      offload_module_name(static_cast<OffloadModule>(m)), static_cast<double>(b) / unit);
        modules += line;
      }
      std::snprintf(line, sizeof line, "     host_offloaded %.4f %s at most in host memory, not in the peak (%s)\n",
                    static_cast<double>(r.host_offloaded.peak) / unit, unit_name, modules.c_str());
      s += line;
    }
    if (r.host_weights + r.host_gradients + r.host_optimizer_state > 0) {
      std::snprintf(line, sizeof line, "     host memory (not in the peak): weights %.4f %s, gradients %.4f %s, "
                    "optimizer_state %.4f %s\n", static_cast<double>(r.host_weights) / unit, unit_name,
                    static_cast<double>(r.host_gradients) / unit, unit_name,
                    static_cast<double>(r.host_optimizer_state) / unit, unit_name);
      s += line;
    }
  }
  return s;
}

nlohmann::json memory_report_json(const std::vector<RankMemoryReport>& ranks, int64_t iteration) {
  nlohmann::json per_rank = nlohmann::json::array();
  for (const RankMemoryReport& r : ranks) {
    nlohmann::json j = {{"rank", r.rank},
                        {"peak_reserved_bytes", r.peak_reserved},
                        {"peak_allocated_bytes", r.peak_allocated},
                        {"parts_sum_bytes", r.parts_sum()},
                        {"allocator_overhead", r.overhead()}};
    for (MemoryCategory c : kCategoryOrder) j[memory_category_name(c)] = r.category_bytes(c);
    nlohmann::json modules = nlohmann::json::object();
    for (const auto& [tag, bytes] : activation_rows(r)) modules[memory_tag_name(tag)] = bytes;
    j["activation_modules"] = modules;
    if (r.host_offloaded.peak > 0) {  // --offload-modules
      nlohmann::json offloaded = nlohmann::json::object();
      for (int m = 0; m < kNumOffloadModules; ++m)
        if (r.host_offloaded.at_peak[static_cast<size_t>(m)] > 0)
          offloaded[offload_module_name(static_cast<OffloadModule>(m))] = r.host_offloaded.at_peak[static_cast<size_t>(m)];
      j["host_offloaded_bytes"] = r.host_offloaded.peak;
      j["host_offloaded_modules"] = offloaded;
    }
    if (r.host_weights + r.host_gradients + r.host_optimizer_state > 0)
      j["host"] = {{"weights", r.host_weights}, {"gradients", r.host_gradients},
                   {"optimizer_state", r.host_optimizer_state}};
    per_rank.push_back(j);
  }
  return {{"iteration", iteration}, {"memory_report", per_rank}};
}

}  // namespace moecore
