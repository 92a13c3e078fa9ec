#include "moecore/comm/communicator.h"

namespace moecore::comm {

void all_reduce_host(Communicator& c, std::vector<double>& values, ReduceOp op) {
  if (values.empty()) return;
  const int64_t n = static_cast<int64_t>(values.size());
  if (c.device().is_cpu()) {
    Tensor t = Tensor::from_vector(values, {n});
    c.all_reduce(t, op);
    values = t.to_vector<double>();
    return;
  }
  std::vector<float> f(values.begin(), values.end());
  Tensor t = Tensor::from_vector(f, {n}).to(c.device());
  c.all_reduce(t, op);
  f = t.to_vector<float>();
  for (size_t i = 0; i < values.size(); ++i) values[i] = f[i];
}

}  // namespace moecore::comm
