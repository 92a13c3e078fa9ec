// The parallel layout of a run, as data (process groups are derived from it; no global state), and its checks.
//
//   world = tp * cp * dp * pp      (attention / dense part: dp is derived)
//         = etp * ep * edp * pp    (experts: edp is derived; Parallel Folding)
//
// `order` names the five dimensions tp, cp, ep, dp, pp joined by '-', left-most varying
// fastest (Megatron's default "tp-cp-ep-dp-pp"). As in Megatron's RankGenerator, a name may be
// left out only if its size is 1 (in both the dense and the expert generator); it is then
// appended at the end. See rank_generator.h for how groups are enumerated from the order.
//
// validate() raises one Error for the first problem found, naming the Megatron flag(s) and
// what was expected. Model dimensions equal to 0 are "unknown" and not checked, so
// validate(c, ModelDims{}) checks the layout alone.
#pragma once

#include <cstdint>
#include <string>

namespace moecore::parallel {

struct ParallelConfig {
  int64_t world = 1;
  int64_t tp = 1, cp = 1, pp = 1, vpp = 1, ep = 1, etp = 1;  // dp and edp are derived
  std::string order = "tp-cp-ep-dp-pp";                        // left-most varies fastest
  int64_t dp() const;   // world / (tp*cp*pp)
  int64_t edp() const;  // world / (etp*ep*pp)
};

struct ModelDims {
  int64_t num_layers = 0, heads = 0, query_groups = 0, experts = 0, expert_ffn = 0;
};

// Checks, in this order: world >= 1; every size >= 1; tp*cp*pp and etp*ep*pp divide world;
// vpp > 1 needs pp > 1; the order (known names, none twice, every name of size > 1 present);
// Megatron's "pp last, or pp == 1, or edp == dp" rule; both generators give the same pp groups;
// then heads % tp, query_groups % tp, experts % ep, num_layers % (pp*vpp), expert_ffn % etp.
void validate(const ParallelConfig& c, const ModelDims& dims);

}  // namespace moecore::parallel
