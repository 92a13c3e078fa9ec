#include "moecore/ops/master_split.h"

namespace moecore::ops::cpu {

void split_master(const Tensor& master, Tensor& high, Tensor& remainder) {
  const float* x = master.data<float>();
  bf16* h = high.data<bf16>();
  int16_t* r = remainder.data<int16_t>();
  const int64_t n = master.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) split_master_value(x[i], h[i].bits, r[i]);
}

void join_master(const Tensor& high, const Tensor& remainder, Tensor& master) {
  const bf16* h = high.data<bf16>();
  const int16_t* r = remainder.data<int16_t>();
  float* x = master.data<float>();
  const int64_t n = master.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] = join_master_value(h[i].bits, r[i]);
}

}  // namespace moecore::ops::cpu
