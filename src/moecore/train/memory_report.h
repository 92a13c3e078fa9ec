// --memory-report: at the first log step, each rank's peak memory split into the categories of
// core/memory_categories.h (weights, gradients, optimizer state, saved activations by module,
// communication buffers, workspace, untagged) plus the allocator's overhead (size rounding and
// cached free blocks at the moment of the peak), in GB (MB when every peak is below 1 GB) and %
// of the peak, with a check line that the parts sum to the allocator's measured peak (its peak of
// reserved bytes); with --offload-modules a line for the activations held in host memory. The logging rank prints every rank's report and writes it to metrics.jsonl as
// one record
// {"iteration": N, "memory_report": [per rank]}.
//
// The peak is the one the log line shows: on a GPU the log step's (the trainer resets it each
// step), on the CPU the run's so far.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moecore/comm/communicator.h"
#include "moecore/core/allocator.h"
#include "moecore/model/activation_offload.h"

namespace moecore {

struct RankMemoryReport {
  int64_t rank = 0;
  MemoryBreakdown at_peak;       // the ledger's state when the handed-out total peaked
  int64_t peak_reserved = 0;     // the allocator's own counters
  int64_t peak_allocated = 0;
  // --offload-modules: the most host memory the offloaded activations held (not in the device
  // peak) and each offload module's share then.
  OffloadHostUsage host_offloaded;
  // Host memory outside the device's peak (the pinned allocator's live bytes now: the optimizer
  // state --optimizer-cpu-offload keeps there): weights (fp32 masters), gradients (their copies),
  // optimizer_state (moments). Printed and recorded ("host") when not all zero.
  int64_t host_weights = 0, host_gradients = 0, host_optimizer_state = 0;
  int64_t overhead() const { return at_peak.rounding + (at_peak.reserved - at_peak.allocated); }
  int64_t parts_sum() const { return at_peak.tagged_sum() + overhead(); }
  int64_t category_bytes(MemoryCategory c) const;  // activations: every module summed
};

// This rank's report from its allocator (accounting must have been on since the start).
RankMemoryReport local_memory_report(const CachingAllocator& allocator, int64_t rank);
// Every rank's report on every rank (collective over `world`; null: one rank).
std::vector<RankMemoryReport> gather_memory_reports(comm::Communicator* world, const RankMemoryReport& mine,
                                                    int64_t world_size);
// The printed report; the check line says "within 3%" or "OFF BY".
std::string format_memory_report(const std::vector<RankMemoryReport>& ranks, int64_t iteration);
nlohmann::json memory_report_json(const std::vector<RankMemoryReport>& ranks, int64_t iteration);

}  // namespace moecore
