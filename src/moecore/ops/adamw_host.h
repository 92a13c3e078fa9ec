// AdamW over many pieces of host memory at once (--optimizer-cpu-offload): the pieces are cut into
// chunks that a few std::threads take in turn, each chunk updated by ops::adamw_step on the
// taking thread (parallel = false): the CPU backend's element function, so the results are
// bit-identical to a CPU (or CUDA) AdamW of the same inputs, whatever the chunking.
#pragma once

#include <vector>

#include "moecore/ops/adamw.h"

namespace moecore::ops {

struct HostAdamWPiece {
  Tensor param, grad, exp_avg, exp_avg_sq;  // host tensors of one length (as adamw_step takes them)
  Tensor compute_weight;                    // optional: bf16, receives the updated param rounded
  AdamWConfig config;  // with a device step (below): only whether weight_decay > 0 counts
};

// threads <= 0: std::thread::hardware_concurrency(). Errors of any chunk are raised here.
void adamw_step_host(std::vector<HostAdamWPiece>& pieces, float grad_scale, int threads = 0);
// The same with the coefficients and skip flag of a step decided on the device (adamw.h:
// AdamWDeviceStep), copied into host memory: `step` is a CPU tensor of make_adamw_device_step.
void adamw_step_host(std::vector<HostAdamWPiece>& pieces, const Tensor& step, int threads = 0);

}  // namespace moecore::ops
