// The op test harness: every op test uses these helpers.
//
// What it checks
//  1. Backends agree: expect_devices_match() runs an op on the device under test (CUDA) and
//     on the reference device (CPU) with the same fresh random inputs; outputs are poisoned
//     (NaN) first, so an element the op never writes fails the test, and values are compared
//     with per-dtype tolerances (default_tolerance) unless the test gives its own.
//  2. Gradients are right: expect_gradients_match() holds an op's backward to central finite
//     differences of its forward, in f64 on the CPU, for the scalar L = sum_o <w_o, out_o>
//     with fresh random weights w_o (so every output element matters).
//
// Inputs are fresh random numbers in every run (seed printed on failure; set
// MOECORE_TEST_SEED to replay one).
//
// How to add an op to the tests (see tests/unit/test_softmax.cpp for a commented example):
//  - a CPU test against a formula or a hand-computed case (unit label);
//  - a gradient check in f64 through expect_gradients_match (unit label);
//  - a CUDA-vs-CPU test in tests/gpu through expect_devices_match, for each dtype the CUDA
//    op supports (gpu label; skipped with a message where no GPU is present).
// Tolerances: f32 1e-5 relative; bf16 1e-2 (8 mantissa bits: one rounding is 0.4%);
// fp8 e4m3 and e5m2 one step of their mantissa (12.5% and 25%). Ops that sum many
// low-precision terms may widen these, with a comment saying why.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/core/tensor.h"

namespace moecore::testing {

struct Tolerance {
  double atol;
  double rtol;
};
Tolerance default_tolerance(DType dtype);

// A new seed for every call (base from MOECORE_TEST_SEED or the clock, logged once).
uint64_t fresh_seed();
// Uniform random tensor in [lo, hi) (fresh seed), created on the CPU and moved to `device`.
Tensor random_tensor(const Shape& shape, DType dtype, Device device = Device::cpu(), double lo = -1.0,
                     double hi = 1.0);
// A tensor whose every element is NaN (floating dtypes) or 0xA5 bytes (integers).
Tensor poisoned(const Shape& shape, DType dtype, Device device = Device::cpu());

// Host copy as doubles, whatever the dtype and device.
std::vector<double> to_doubles(const Tensor& t);

// Success when no element is still the poison value (NaN for floating dtypes).
::testing::AssertionResult all_written(const Tensor& t);
// |actual - expected| <= atol + rtol * |expected| everywhere; NaN never passes.
::testing::AssertionResult allclose(const Tensor& actual, const Tensor& expected, Tolerance tol);

struct OutputSpec {
  Shape shape;
  DType dtype;
};
using OpFn = std::function<void(const std::vector<Tensor>& inputs, std::vector<Tensor>& outputs)>;

// Runs fn on copies of `inputs` on test_device and reference_device, each with freshly poisoned
// outputs, and expects every output written and close. Use tolerances per output or one for all.
void expect_devices_match(Device test_device, Device reference_device, const std::vector<Tensor>& inputs,
                          const std::vector<OutputSpec>& outputs, const OpFn& fn,
                          const std::vector<Tolerance>& tolerances);
// CUDA (device 0) against CPU.
void expect_cuda_matches_cpu(const std::vector<Tensor>& inputs, const std::vector<OutputSpec>& outputs,
                             const OpFn& fn, const std::vector<Tolerance>& tolerances);

using ForwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;
// Returns d L / d input for each input (undefined Tensor for inputs without a gradient).
using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs,
                                                     const std::vector<Tensor>& grad_outputs)>;
struct GradCheckOptions {
  double step = 1e-6;        // central-difference step
  double atol = 1e-7;        // the difference error is O(step^2) + O(1e-16 / step)
  double rtol = 1e-5;
  int64_t max_elements = 64;  // per input; larger inputs are checked at random positions
};
// inputs must be f64 CPU tensors.
void expect_gradients_match(const std::vector<Tensor>& inputs, const ForwardFn& forward, const BackwardFn& backward,
                            const GradCheckOptions& options = {});

}  // namespace moecore::testing

// At the top of a GPU test: skips it, saying why, where no CUDA device is usable.
#define MC_REQUIRE_CUDA()                                                                     \
  do {                                                                                        \
    if (::moecore::cuda_device_count() == 0)                                                  \
      GTEST_SKIP() << "no CUDA device: " << ::moecore::cuda_unavailable_reason();             \
  } while (0)
