// Received rows and the EP collectives' clocks of a step, and their reduction over the EP group
// (see dispatch_load.h for the method).
#include "moecore/moe/dispatch_load.h"

#include <memory>

#include "moecore/comm/emulated_communicator.h"

namespace moecore {

namespace {

// The training loop's thread only (as the step timers).
struct Clocks {
  bool armed = false;
  int64_t received_rows = 0;
  bool any_layer = false;
  std::vector<std::unique_ptr<Event>> starts, ends;
};

Clocks& clocks() {
  static Clocks c;
  return c;
}

}  // namespace

void arm_dispatch_clocks(bool on) { clocks().armed = on; }
bool dispatch_clocks_armed() { return clocks().armed; }

void add_received_rows(int64_t rows) {
  clocks().received_rows += rows;
  clocks().any_layer = true;
}

CollectiveClock::CollectiveClock(Device device, bool on) {
  Clocks& c = clocks();
  if (!on || !c.armed) return;
  index_ = static_cast<int>(c.starts.size());
  c.starts.push_back(std::make_unique<Event>(device));
  c.ends.push_back(std::make_unique<Event>(device));
  c.starts.back()->record();
}

CollectiveClock::~CollectiveClock() {
  if (index_ >= 0) clocks().ends[static_cast<size_t>(index_)]->record();
}

DispatchLoadSample take_dispatch_load() {
  Clocks& c = clocks();
  DispatchLoadSample s;
  s.received_rows = c.received_rows;
  s.any_layer = c.any_layer;
  for (size_t i = 0; i < c.starts.size(); ++i) s.collective_ms.push_back(c.ends[i]->elapsed_ms_since(*c.starts[i]));
  c.received_rows = 0;
  c.any_layer = false;
  c.starts.clear();
  c.ends.clear();
  return s;
}

DispatchLoadReport reduce_dispatch_load(const DispatchLoadSample& s, comm::Communicator* ep) {
  DispatchLoadReport r;
  if (!ep || ep->size() <= 1 || comm::is_emulated(ep)) return r;
  const double ranks = static_cast<double>(ep->size());
  const double rows = static_cast<double>(s.received_rows), n = static_cast<double>(s.collective_ms.size());
  std::vector<double> maxes = {rows, -rows, n, -n, s.any_layer ? 1.0 : 0.0};
  comm::all_reduce_host(*ep, maxes, comm::ReduceOp::Max);
  if (maxes[4] == 0) return r;  // no MoE layer here
  r.valid = true;
  r.rows_max = maxes[0];
  r.rows_min = -maxes[1];
  // The collectives are matched across the group; a differing count would pair unrelated ones.
  r.timed = maxes[2] > 0 && maxes[2] == -maxes[3];
  double wait = 0, comm_ms = 0;
  if (r.timed) {
    std::vector<double> fastest = s.collective_ms;
    comm::all_reduce_host(*ep, fastest, comm::ReduceOp::Min);
    for (size_t i = 0; i < fastest.size(); ++i) {
      comm_ms += s.collective_ms[i];
      wait += s.collective_ms[i] - fastest[i];
    }
  }
  std::vector<double> sums = {rows, wait, comm_ms};
  comm::all_reduce_host(*ep, sums, comm::ReduceOp::Sum);
  r.rows_mean = sums[0] / ranks;
  r.imbalance = r.rows_mean > 0 ? r.rows_max / r.rows_mean : 0.0;
  if (r.timed) {
    std::vector<double> worst = {wait};
    comm::all_reduce_host(*ep, worst, comm::ReduceOp::Max);
    r.comm_ms_mean = sums[2] / ranks;
    r.wait_ms_mean = sums[1] / ranks;
    r.wait_ms_max = worst[0];
  }
  return r;
}

}  // namespace moecore
