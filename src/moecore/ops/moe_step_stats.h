// A MoE layer's step statistics packed on the device (moe/moe_stats.h), so that a training step
// reduces them over the ranks and updates the expert bias without a host read. f64 [E + 4]:
//   [0] the aux-loss sum / aux coeff, [1] the z-loss sum / z coeff, [2, 2 + E) tokens per expert,
//   [2 + E], [3 + E] the routing checks' flags (an expert index outside [0, E), an expert over its
//   padded capacity; ops::accumulate_routing_counts).
// pack_moe_step_stats: packed = {aux / aux_coeff, z / z_coeff, host_counts[e] + counts[e], counts[E],
//   counts[E + 1]}; aux, z: [1] f32 / bf16 / f64 (read as f32 unless f64, then widened, as the host
//   read them) or undefined (0); counts i64 [E + 2] or undefined; host_counts f64 [E] or undefined.
// finish_moe_step_stats: packed[0], packed[1] /= dp_size (the losses averaged over DP after the
//   sums), then with bias defined (f32 or f64 [E]) the aux-loss-free balancing update
//   mean = sum_e c_e / E, bias_e = (dtype)((double)bias_e + rate * sign(mean - c_e)).
// Both in double in the host's order (one thread on the GPU): the host's bits.
#pragma once

#include "moecore/core/host_device.h"
#include "moecore/core/tensor.h"

namespace moecore::ops {

void pack_moe_step_stats(const Tensor& aux, const Tensor& z, const Tensor& counts, const Tensor& host_counts,
                         double aux_coeff, double z_coeff, Tensor& packed);
void finish_moe_step_stats(Tensor& packed, double dp_size, Tensor& bias, double rate);

namespace moe_stats_detail {
// The shared element functions (CPU and CUDA).
template <typename B>
MC_HD void update_bias(const double* c, int64_t e, double rate, B* bias) {
  double mean = 0;
  for (int64_t i = 0; i < e; ++i) mean = mean + c[i];
  mean = mean / static_cast<double>(e);
  for (int64_t i = 0; i < e; ++i) {
    const double d = mean - c[i];
    bias[i] = static_cast<B>(static_cast<double>(bias[i]) + rate * (d > 0 ? 1.0 : (d < 0 ? -1.0 : 0.0)));
  }
}
}  // namespace moe_stats_detail

namespace cuda {
void pack_moe_step_stats(const Tensor& aux, const Tensor& z, const Tensor& counts, const Tensor& host_counts,
                         double aux_coeff, double z_coeff, Tensor& packed);
void finish_moe_step_stats(Tensor& packed, double dp_size, Tensor& bias, double rate);
}  // namespace cuda

}  // namespace moecore::ops
