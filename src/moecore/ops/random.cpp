#include "moecore/ops/random.h"

#include "moecore/core/philox.h"
#include "moecore/ops/common.h"

namespace moecore::ops {

namespace {
void run(const char* op, bool normal, Tensor& t, uint64_t seed, uint64_t key, double a, double b, int64_t offset) {
  check_contiguous(op, "t", t);
  MC_CHECK(is_floating(t.dtype()), op, ": t has dtype ", dtype_name(t.dtype()), "; expected a floating dtype");
  MC_CHECK(offset >= 0, op, ": negative index_offset ", offset);
  if (t.device().is_cpu()) {
    cpu::fill_random(normal, t, seed, key, a, b, offset);
  } else {
    MC_CHECK(t.dtype() != DType::F64, op, ": f64 is CPU-only");
    MC_CUDA_BACKEND(op, cuda::fill_random(normal, t, seed, key, a, b, offset));
  }
}
}  // namespace

void fill_uniform(Tensor& t, uint64_t seed, uint64_t key, double lo, double hi, int64_t index_offset) {
  MC_CHECK(lo <= hi, "fill_uniform: lo ", lo, " > hi ", hi);
  run("fill_uniform", false, t, seed, key, lo, hi, index_offset);
}

void fill_normal(Tensor& t, uint64_t seed, uint64_t key, double mean, double std, int64_t index_offset) {
  MC_CHECK(std >= 0, "fill_normal: negative std ", std);
  run("fill_normal", true, t, seed, key, mean, std, index_offset);
}

namespace cpu {
void fill_random(bool normal, Tensor& t, uint64_t seed, uint64_t key, double a, double b, int64_t offset) {
  dispatch_floating(t.dtype(), "fill_random", [&](auto tag) {
    using T = decltype(tag);
    using C = Compute<T>;
    T* p = t.data<T>();
    const int64_t n = t.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t idx = static_cast<uint64_t>(offset + i);
      // Same arithmetic as the CUDA kernel (fp32 types): bit-identical uniforms.
      C v;
      if (normal) {
        v = static_cast<C>(normal_scaled(a, b, philox_normal(seed, key, idx)));
      } else if constexpr (std::is_same_v<C, double>) {
        v = a + (b - a) * static_cast<double>(philox_uniform(seed, key, idx));
      } else {
        v = uniform_between(static_cast<float>(a), static_cast<float>(b), philox_uniform(seed, key, idx));
      }
      p[i] = store<T>(v);
    }
  });
}
}  // namespace cpu

}  // namespace moecore::ops
