// The timer of the multi-rank benchmarks (bench_comm, bench_dispatch; `mpirun -np N`): seconds per
// call of fn() as the median of 5 runs of 10 back-to-back calls after `warmups` untimed calls;
// each run starts at a barrier of the group, ends when this rank's device has finished, and
// counts as the slowest rank's time (a max over MPI_COMM_WORLD).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "moecore/comm/communicator.h"
#include "moecore/core/device.h"

namespace moecore::bench {

template <typename F>
double slowest_rank_seconds(comm::Communicator& group, Device dev, int warmups, F&& fn) {
  for (int i = 0; i < warmups; ++i) fn();
  std::vector<double> runs;
  for (int r = 0; r < 5; ++r) {
    synchronize(dev);
    group.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) fn();
    synchronize(dev);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10;
    MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    runs.push_back(s);
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

}  // namespace moecore::bench
