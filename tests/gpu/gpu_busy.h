// Busy work for the gpu tests that check what the host does while the GPU is still working.
#pragma once

#include "moecore/core/device.h"

namespace moecore::testing {

// Enqueues on the device's current stream one kernel that runs for `milliseconds` of GPU time
// (it spins on the GPU's global timer), and returns at once. A fixed GPU time keeps such tests
// independent of how fast the card is: GEMM-based busy work drains in ~20 ms on an H200, less
// than a first pinned-memory allocation can take on the host.
void hold_gpu(Device device, double milliseconds);

}  // namespace moecore::testing
