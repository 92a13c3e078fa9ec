// Busy work for the gpu tests that check what the host does while the GPU is still working.
#pragma once

#include "moecore/core/device.h"

namespace moecore::testing {

// Enqueues on the device's current stream one kernel that runs for `milliseconds` of GPU time
// (it spins on the GPU's global timer), and returns at once. A fixed GPU time keeps such tests
// independent of how fast the card is: GEMM-based busy work drained on a fast card, once before
// the test's own host work (a first pinned allocation among it) was done.
void hold_gpu(Device device, double milliseconds);

}  // namespace moecore::testing
