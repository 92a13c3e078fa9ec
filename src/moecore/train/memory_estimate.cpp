#include "moecore/train/memory_estimate.h"

#include <unistd.h>

#include <algorithm>

#include "moecore/core/system_info.h"
#include "moecore/model/param_count.h"

namespace moecore {

StateMemory estimate_state_memory(const ModelConfig& cfg, const StateLayout& l) {
  const ParamCount count = count_parameters(cfg);
  const double experts = static_cast<double>(count.part("routed_experts"));
  const double dense = static_cast<double>(count.total) - experts;
  StateMemory m;
  m.params = count.total;
  m.params_per_rank = dense / static_cast<double>(l.tp * l.pp) + experts / static_cast<double>(l.ep * l.etp * l.pp);
  // Per parameter: the weight the model computes with and its gradient (compute dtype), the fp32
  // master (with bf16 at least the 2 bytes beside the bf16 copy) and the two moments; the
  // distributed optimizer shards masters and moments over the data-parallel ranks.
  const double compute = l.bf16 ? 2.0 : 4.0;
  const double master = l.bf16 ? 2.0 : 0.0;  // fp32 compute: the master is the weight
  const double optimizer = (master + static_cast<double>(l.exp_avg_bytes + l.exp_avg_sq_bytes)) /
                           static_cast<double>(l.distributed_optimizer ? std::max<int64_t>(1, l.dp) : 1);
  m.bytes_per_rank = m.params_per_rank * (2 * compute + optimizer);
  return m;
}

double device_memory_bytes(bool cuda, int device_index, int64_t local_ranks) {
  if (cuda) {
    const nlohmann::json info = system_info();
    if (!info.contains("cuda_devices")) return 0;
    for (const auto& d : info["cuda_devices"])
      if (d.value("index", -1) == device_index) return d.value("memory_bytes", 0.0);
    return 0;
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return static_cast<double>(pages) * static_cast<double>(page) / static_cast<double>(std::max<int64_t>(1, local_ranks));
}

}  // namespace moecore
