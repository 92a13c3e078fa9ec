// The benchmarks' timer: median milliseconds per call of fn() over `repeats` runs of `iters`
// back-to-back calls, each run between two CUDA events, after `warmups` untimed calls; and the
// copy-bandwidth ceiling of memory-bound benchmarks.
#pragma once

#include <algorithm>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/core/tensor.h"

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

// A device-to-device copy of 1 GiB, timed as above (the median of 5): bytes read + bytes written
// per second.
inline double copy_bandwidth(Device dev) {
  const int64_t n = int64_t{1} << 29;  // 1 GiB of bf16
  Tensor a = Tensor::zeros({n}, DType::BF16, dev), b = Tensor::empty({n}, DType::BF16, dev);
  const double ms = time_ms(dev, 1, 5, [&] { b.copy_from(a); });
  return 2.0 * static_cast<double>(a.nbytes()) / (ms * 1e-3);
}

}  // namespace moecore::bench
