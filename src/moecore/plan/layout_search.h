// `moecore plan --search`: every (TP, CP, PP, VPP) x (EP, ETP) layout of a cluster (DP and EDP
// follow: Parallel Folding, the expert layout independent of the attention layout) with the
// recomputation choices none, selective moe_act, full uniform per layer, each checked by the
// train command's own parsing (an invalid layout is skipped), predicted, dropped when its largest
// rank does not fit, and ranked by predicted tokens/s.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "moecore/plan/hardware.h"
#include "moecore/plan/memory_model.h"
#include "moecore/plan/step_time.h"
#include "moecore/train/arguments.h"

namespace moecore::plan {

struct SearchSpace {
  std::vector<std::string> base_argv;  // the user's flags; the layout and recompute flags are replaced
  // Parses and checks one candidate's flags as the train command does (throws when invalid).
  std::function<TrainArgs(const std::vector<std::string>&)> parse;
};

struct Candidate {
  std::vector<std::string> layout_flags;  // the flags that select this layout
  std::string recompute;                  // "none", "moe_act", "mla+moe_act", "full"
  int64_t tp = 1, cp = 1, pp = 1, vpp = 1, dp = 1, ep = 1, etp = 1, edp = 1;
  double peak_bytes = 0;
  StepTime time;
};

// Fitting layouts, best first; `considered` / `valid` counts in the first entry's notes.
std::vector<Candidate> search_layouts(const SearchSpace& space, const PlanOptions& o, const HardwareProfile& hw,
                                      const Cluster& cl, double memory_limit);
// The best `top` as a table, then one JSON line.
std::string format_search(const std::vector<Candidate>& ranked, const Cluster& cl, const HardwareProfile& hw,
                          size_t top);

}  // namespace moecore::plan
