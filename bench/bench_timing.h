// The benchmarks' timer: median milliseconds per call of fn() over `repeats` runs of `iters`
// back-to-back calls, each run between two CUDA events, after `warmups` untimed calls.
#pragma once

#include <algorithm>
#include <vector>

#include "moecore/core/device.h"

namespace moecore::bench {

template <typename F>
double time_ms(Device dev, int iters, int repeats, F&& fn, int warmups = 2) {
  for (int w = 0; w < warmups; ++w) fn();
  synchronize(dev);
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    Event start(dev), stop(dev);
    start.record();
    for (int i = 0; i < iters; ++i) fn();
    stop.record();
    stop.synchronize();
    times.push_back(stop.elapsed_ms_since(start) / iters);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace moecore::bench
