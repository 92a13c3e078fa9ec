#include "op_harness.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "moecore/core/philox.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/random.h"

namespace moecore::testing {

Tolerance default_tolerance(DType dtype) {
  switch (dtype) {
    case DType::F64: return {1e-12, 1e-10};
    case DType::F32: return {1e-5, 1e-5};
    case DType::BF16: return {1e-2, 1e-2};
    case DType::FP8E4M3: return {0.0625, 0.125};
    case DType::FP8E5M2: return {0.125, 0.25};
    default: return {0, 0};  // integers: exact
  }
}

uint64_t fresh_seed() {
  static uint64_t base = [] {
    const char* env = std::getenv("MOECORE_TEST_SEED");
    const uint64_t b = env ? std::strtoull(env, nullptr, 10)
                           : static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("[op_harness] MOECORE_TEST_SEED=%llu\n", static_cast<unsigned long long>(b));
    return b;
  }();
  static uint64_t counter = 0;
  return base + 0x9E3779B97F4A7C15ull * ++counter;
}

Tensor random_tensor(const Shape& shape, DType dtype, Device device, double lo, double hi) {
  Tensor t = Tensor::empty(shape, dtype, Device::cpu());
  ops::fill_uniform(t, fresh_seed(), rng_key("test-input"), lo, hi);
  return t.to(device);
}

Tensor poisoned(const Shape& shape, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  if (is_floating(dtype)) {
    ops::fill(t, std::numeric_limits<double>::quiet_NaN());
  } else {
    Tensor host = Tensor::empty(shape, dtype, Device::cpu());
    std::memset(host.data_ptr(), 0xA5, host.nbytes());
    t.copy_from(host);
  }
  return t;
}

std::vector<double> to_doubles(const Tensor& t) {
  const Tensor host = t.to(Device::cpu()).contiguous();
  std::vector<double> out(static_cast<size_t>(host.numel()));
  const int64_t n = host.numel();
  switch (host.dtype()) {
    case DType::F32: for (int64_t i = 0; i < n; ++i) out[i] = host.data<float>()[i]; break;
    case DType::F64: for (int64_t i = 0; i < n; ++i) out[i] = host.data<double>()[i]; break;
    case DType::BF16: for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(host.data<bf16>()[i]); break;
    case DType::FP8E4M3: for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(host.data<fp8e4m3>()[i]); break;
    case DType::FP8E5M2: for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(host.data<fp8e5m2>()[i]); break;
    case DType::I32: for (int64_t i = 0; i < n; ++i) out[i] = host.data<int32_t>()[i]; break;
    case DType::I64: for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(host.data<int64_t>()[i]); break;
    case DType::U8: for (int64_t i = 0; i < n; ++i) out[i] = host.data<uint8_t>()[i]; break;
    case DType::I16: for (int64_t i = 0; i < n; ++i) out[i] = host.data<int16_t>()[i]; break;
  }
  return out;
}

::testing::AssertionResult all_written(const Tensor& t) {
  if (is_floating(t.dtype())) {
    const std::vector<double> v = to_doubles(t);
    int64_t unwritten = 0, first = -1;
    for (size_t i = 0; i < v.size(); ++i)
      if (std::isnan(v[i])) {
        if (first < 0) first = static_cast<int64_t>(i);
        ++unwritten;
      }
    if (unwritten == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << t.describe() << ": " << unwritten << " of " << v.size()
                                         << " elements still hold the poison (NaN); first at flat index " << first;
  }
  const Tensor host = t.to(Device::cpu()).contiguous();
  const auto* bytes = static_cast<const uint8_t*>(host.data_ptr());
  const size_t elem = dtype_size(t.dtype());
  for (int64_t i = 0; i < host.numel(); ++i) {
    bool poison = true;
    for (size_t b = 0; b < elem; ++b) poison = poison && bytes[static_cast<size_t>(i) * elem + b] == 0xA5;
    if (poison) return ::testing::AssertionFailure() << t.describe() << ": element " << i << " still holds the poison";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult allclose(const Tensor& actual, const Tensor& expected, Tolerance tol) {
  if (actual.shape() != expected.shape())
    return ::testing::AssertionFailure() << "shape " << shape_str(actual.shape()) << " vs expected "
                                         << shape_str(expected.shape());
  const std::vector<double> a = to_doubles(actual), e = to_doubles(expected);
  int64_t bad = 0, worst = -1;
  double worst_excess = -1;
  for (size_t i = 0; i < a.size(); ++i) {
    const double diff = std::fabs(a[i] - e[i]);
    const double allowed = tol.atol + tol.rtol * std::fabs(e[i]);
    const bool ok = !std::isnan(a[i]) && !std::isnan(e[i]) && (diff <= allowed || a[i] == e[i]);
    if (!ok) {
      ++bad;
      const double excess = std::isnan(diff) ? std::numeric_limits<double>::infinity() : diff - allowed;
      if (excess > worst_excess) {
        worst_excess = excess;
        worst = static_cast<int64_t>(i);
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  const size_t w = static_cast<size_t>(worst);
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " elements differ beyond atol " << tol.atol
                                       << " + rtol " << tol.rtol << "; worst at flat index " << worst << ": "
                                       << a[w] << " vs expected " << e[w] << " (" << actual.describe() << ")";
}

void expect_devices_match(Device test_device, Device reference_device, const std::vector<Tensor>& inputs,
                          const std::vector<OutputSpec>& outputs, const OpFn& fn,
                          const std::vector<Tolerance>& tolerances) {
  ASSERT_TRUE(tolerances.size() == 1 || tolerances.size() == outputs.size())
      << "give one tolerance, or one per output";
  auto run_on = [&](Device d) {
    std::vector<Tensor> in, out;
    for (const Tensor& t : inputs) in.push_back(t.to(d));
    for (const OutputSpec& s : outputs) out.push_back(poisoned(s.shape, s.dtype, d));
    fn(in, out);
    synchronize(d);
    return out;
  };
  const std::vector<Tensor> got = run_on(test_device);
  const std::vector<Tensor> want = run_on(reference_device);
  for (size_t i = 0; i < outputs.size(); ++i) {
    EXPECT_TRUE(all_written(got[i])) << "output " << i << " on " << test_device.str();
    EXPECT_TRUE(all_written(want[i])) << "output " << i << " on " << reference_device.str() << " (reference)";
    EXPECT_TRUE(allclose(got[i], want[i], tolerances.size() == 1 ? tolerances[0] : tolerances[i]))
        << "output " << i << ": " << test_device.str() << " vs " << reference_device.str();
  }
}

void expect_cuda_matches_cpu(const std::vector<Tensor>& inputs, const std::vector<OutputSpec>& outputs,
                             const OpFn& fn, const std::vector<Tolerance>& tolerances) {
  expect_devices_match(Device::cuda(0), Device::cpu(), inputs, outputs, fn, tolerances);
}

namespace {
double weighted_sum(const std::vector<Tensor>& outs, const std::vector<Tensor>& weights) {
  double s = 0;
  for (size_t o = 0; o < outs.size(); ++o) {
    const double* po = outs[o].data<double>();
    const double* pw = weights[o].data<double>();
    for (int64_t i = 0; i < outs[o].numel(); ++i) s += po[i] * pw[i];
  }
  return s;
}
}  // namespace

void expect_gradients_match(const std::vector<Tensor>& inputs, const ForwardFn& forward, const BackwardFn& backward,
                            const GradCheckOptions& opt) {
  for (const Tensor& t : inputs)
    ASSERT_TRUE(t.dtype() == DType::F64 && t.device().is_cpu()) << "gradient checks take f64 CPU inputs, got "
                                                                 << t.describe();
  const std::vector<Tensor> outs = forward(inputs);
  std::vector<Tensor> weights;
  for (const Tensor& o : outs) weights.push_back(random_tensor(o.shape(), DType::F64));
  const std::vector<Tensor> grads = backward(inputs, weights);
  ASSERT_EQ(grads.size(), inputs.size()) << "backward must return one gradient per input (undefined for none)";

  const uint64_t pick_seed = fresh_seed();
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!grads[k].defined()) continue;
    ASSERT_EQ(grads[k].shape(), inputs[k].shape()) << "gradient of input " << k;
    const int64_t n = inputs[k].numel();
    const int64_t checks = std::min(n, opt.max_elements);
    for (int64_t c = 0; c < checks; ++c) {
      const int64_t j = n <= opt.max_elements
                            ? c
                            : static_cast<int64_t>(philox_words(pick_seed, k, static_cast<uint64_t>(c)).w[0] % n);
      std::vector<Tensor> plus, minus;
      for (const Tensor& t : inputs) {
        plus.push_back(t.clone());
        minus.push_back(t.clone());
      }
      plus[k].data<double>()[j] += opt.step;
      minus[k].data<double>()[j] -= opt.step;
      const double numeric = (weighted_sum(forward(plus), weights) - weighted_sum(forward(minus), weights)) /
                             (2 * opt.step);
      const double analytic = grads[k].data<double>()[j];
      EXPECT_LE(std::fabs(numeric - analytic), opt.atol + opt.rtol * std::fabs(numeric))
          << "input " << k << " element " << j << ": analytic " << analytic << " vs finite difference " << numeric;
    }
  }
}

}  // namespace moecore::testing
