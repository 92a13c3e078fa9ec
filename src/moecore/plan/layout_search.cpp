#include "moecore/plan/layout_search.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"

namespace moecore::plan {

namespace {

// Flags the search sets itself: dropped from the user's (with their values).
const std::set<std::string>& layout_flag_names() {
  static const std::set<std::string> names = {
      "tensor-model-parallel-size", "pipeline-model-parallel-size", "num-virtual-stages-per-pipeline-rank",
      "num-layers-per-virtual-pipeline-stage", "context-parallel-size", "expert-model-parallel-size",
      "expert-tensor-parallel-size", "sequence-parallel", "recompute-granularity", "recompute-method",
      "recompute-num-layers", "recompute-modules", "moe-layer-recompute", "search"};
  return names;
}

std::vector<std::string> without_layout_flags(const std::vector<std::string>& argv) {
  std::vector<std::string> out;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& s = argv[i];
    if (s.rfind("--", 0) != 0) {
      out.push_back(s);
      continue;
    }
    const size_t eq = s.find('=');
    const std::string name = s.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    if (!layout_flag_names().count(name)) {
      out.push_back(s);
      continue;
    }
    if (eq != std::string::npos) continue;
    while (i + 1 < argv.size() && argv[i + 1].rfind("--", 0) != 0) ++i;  // its values
  }
  return out;
}

std::vector<int64_t> divisors(int64_t n, int64_t at_most) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= std::min(n, at_most); ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

}  // namespace

std::vector<Candidate> search_layouts(const SearchSpace& space, const PlanOptions& o, const HardwareProfile& hw,
                                      const Cluster& cl, double memory_limit) {
  const std::vector<std::string> base = without_layout_flags(space.base_argv);
  const TrainArgs model = space.parse(base);  // the model (and an error for bad base flags)
  const int64_t n = cl.gpus, layers = model.model.num_layers, experts = model.model.moe.num_experts;
  std::vector<std::pair<std::string, std::vector<std::string>>> recompute = {
      {"none", {}},
      {"moe_act", {"--recompute-granularity", "selective", "--recompute-modules", "moe_act"}},
      {"full", {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"}}};
  if (model.model.mla.enabled)  // MLA: the up projections too (CP excluded by the train command's check)
    recompute.insert(recompute.begin() + 2, {"mla+moe_act", {"--recompute-granularity", "selective", "--recompute-modules",
                                                             "mla_up_proj", "moe_act"}});
  std::vector<Candidate> fitting;
  for (int64_t tp : divisors(n, cl.gpus_per_node))
    for (int64_t cp : divisors(n / tp, 2))
      for (int64_t pp : divisors(n / (tp * cp), layers))
        for (int64_t vpp : divisors(layers / pp, pp > 1 ? 8 : 1))
          for (int64_t ep : divisors(n / pp, std::max<int64_t>(1, experts)))
            for (int64_t etp : divisors(n / (pp * ep), std::max<int64_t>(1, tp))) {
              if (layers % (pp * vpp) != 0 || (vpp > 1 && (vpp & (vpp - 1)) != 0)) continue;
              if (experts == 0 && (ep > 1 || etp > 1)) continue;
              if (experts > 0 && experts % ep != 0) continue;
              for (const auto& [name, flags] : recompute) {
                if (name.find("moe_act") != std::string::npos && experts == 0) continue;
                std::vector<std::string> argv = base;
                std::vector<std::string> lf = {"--tensor-model-parallel-size", std::to_string(tp),
                                               "--context-parallel-size", std::to_string(cp),
                                               "--pipeline-model-parallel-size", std::to_string(pp),
                                               "--expert-model-parallel-size", std::to_string(ep),
                                               "--expert-tensor-parallel-size", std::to_string(etp)};
                if (vpp > 1) lf.insert(lf.end(), {"--num-virtual-stages-per-pipeline-rank", std::to_string(vpp)});
                if (tp > 1) lf.push_back("--sequence-parallel");
                lf.insert(lf.end(), flags.begin(), flags.end());
                argv.insert(argv.end(), lf.begin(), lf.end());
                TrainArgs a;
                try {
                  a = space.parse(argv);
                } catch (const Error&) {
                  continue;  // a layout the train command refuses
                }
                double peak = 0;
                for (const StageMemory& s : predict_memory(a, o)) peak = std::max(peak, s.parts.total());
                if (memory_limit > 0 && peak > memory_limit) continue;
                Candidate c;
                c.layout_flags = lf;
                c.recompute = name;
                c.tp = tp, c.cp = cp, c.pp = pp, c.vpp = vpp, c.ep = ep, c.etp = etp;
                c.dp = a.data_parallel_size();
                c.edp = n / (pp * ep * etp);
                c.peak_bytes = peak;
                c.time = predict_step_time(a, o, hw, cl);
                fitting.push_back(std::move(c));
              }
            }
  std::stable_sort(fitting.begin(), fitting.end(),
                   [](const Candidate& x, const Candidate& y) { return x.time.tokens_per_s > y.time.tokens_per_s; });
  return fitting;
}

std::string format_search(const std::vector<Candidate>& ranked, const Cluster& cl, const HardwareProfile& hw,
                          size_t top) {
  std::string s;
  char line[512];
  std::snprintf(line, sizeof line, "moecore plan --search: %lld GPUs (%s, %lld per node): %zu layouts fit; the best %zu:\n",
                static_cast<long long>(cl.gpus), hw.name.c_str(), static_cast<long long>(cl.gpus_per_node),
                ranked.size(), std::min<size_t>(top, ranked.size()));
  s += line;
  s += " rank  TP CP PP VPP  DP |  EP ETP EDP  recompute   memory GB   step s   tokens/s  TFLOP/s/GPU   MFU\n";
  nlohmann::json best = nlohmann::json::array();
  for (size_t i = 0; i < std::min<size_t>(top, ranked.size()); ++i) {
    const Candidate& c = ranked[i];
    std::snprintf(line, sizeof line, " %4zu %3lld %2lld %2lld %3lld %3lld | %3lld %3lld %3lld  %-11s %9.2f %8.3f %10.0f %12.1f %5.1f%%\n",
                  i + 1, static_cast<long long>(c.tp), static_cast<long long>(c.cp), static_cast<long long>(c.pp),
                  static_cast<long long>(c.vpp), static_cast<long long>(c.dp), static_cast<long long>(c.ep),
                  static_cast<long long>(c.etp), static_cast<long long>(c.edp), c.recompute.c_str(), c.peak_bytes / 1e9,
                  c.time.step_s, c.time.tokens_per_s, c.time.tflops_per_gpu, 100 * c.time.mfu);
    s += line;
    std::string flags;
    for (const std::string& f : c.layout_flags) flags += (flags.empty() ? "" : " ") + f;
    best.push_back({{"rank", i + 1}, {"tp", c.tp}, {"cp", c.cp}, {"pp", c.pp}, {"vpp", c.vpp}, {"dp", c.dp},
                   {"ep", c.ep}, {"etp", c.etp}, {"edp", c.edp}, {"recompute", c.recompute},
                   {"peak_bytes", c.peak_bytes}, {"step_s", c.time.step_s}, {"tokens_per_s", c.time.tokens_per_s},
                   {"tflops_per_gpu", c.time.tflops_per_gpu}, {"mfu", c.time.mfu}, {"flags", flags}});
  }
  s += nlohmann::json({{"fitting", ranked.size()}, {"top", best}}).dump() + "\n";
  return s;
}

}  // namespace moecore::plan
