// Load imbalance of expert parallelism, for the log line (issue 29): how many expert rows each
// EP rank's experts received in a step, and how long this rank's dispatch collectives waited for
// the group's slowest rank.
//
// Received rows: every MoE layer adds the rows its local experts got (the dispatcher's plan has
// them on the host over EP: no wait) for each training micro-batch; take_dispatch_load() returns
// the step's sum and resets it.
//
// Waiting, measured without host waits: on a step the trainer arms (the log steps only), every
// collective of the EP group in the dispatchers (the counts' all-gather, the rows' all-to-alls,
// the allgather dispatcher's gathers and reduce-scatters; not the ETP stage's) is bracketed by two
// events on the stream it runs on (NCCL: the current stream; MPI: the host clock around the
// blocking call). A collective starts on each rank when that rank reaches it and ends when every
// rank has taken part, so its time t_r on rank r is the wait for the last rank to arrive plus the
// transfer. The last rank to arrive waits about nothing, so the minimum over the group m =
// min_r t_r is about the transfer alone, and t_r - m is rank r's wait for the slowest rank. Summed
// over the step's collectives (matched across the group: the same sequence on every rank) this is
// the step's wait. It is an upper bound: with unequal row counts part of t_r - m is this rank's
// longer transfer, not waiting. The events are read after the log step's own synchronisation;
// the reduction over the EP group (reduce_dispatch_load) runs at log steps only.
#pragma once

#include <cstdint>
#include <vector>

#include "moecore/comm/communicator.h"

namespace moecore {

// The trainer arms the collective clocks for a step it will log (off: nothing is recorded).
void arm_dispatch_clocks(bool on);
bool dispatch_clocks_armed();

// A MoE layer's received expert rows of one training micro-batch.
void add_received_rows(int64_t rows);

// This rank's step: received rows and the time of each EP collective (ms, in issue order; empty
// unless armed). Reads the events, which must have completed (after the step's synchronisation).
struct DispatchLoadSample {
  int64_t received_rows = 0;
  std::vector<double> collective_ms;
  bool any_layer = false;  // a MoE layer on this rank received rows (EP > 1 dispatch happened)
};
DispatchLoadSample take_dispatch_load();

// Brackets one EP collective with events when armed.
class CollectiveClock {
 public:
  // on: this collective is one of the EP group's (see the header comment).
  CollectiveClock(Device device, bool on);
  ~CollectiveClock();
  CollectiveClock(const CollectiveClock&) = delete;
  CollectiveClock& operator=(const CollectiveClock&) = delete;

 private:
  int index_ = -1;
};

// The EP group's view of one step: received rows per rank (min, max, mean, max / mean) and the
// wait for the slowest rank (mean and max over the ranks), plus the collectives' time (mean).
struct DispatchLoadReport {
  bool valid = false;  // false: no EP group, an emulated one, or the ranks disagree on the collectives
  double rows_min = 0, rows_max = 0, rows_mean = 0, imbalance = 0;
  bool timed = false;  // the collectives were timed (armed step)
  double comm_ms_mean = 0, wait_ms_mean = 0, wait_ms_max = 0;
};
// Collective over ep (every rank of the group calls it at the same point).
DispatchLoadReport reduce_dispatch_load(const DispatchLoadSample& s, comm::Communicator* ep);

}  // namespace moecore
