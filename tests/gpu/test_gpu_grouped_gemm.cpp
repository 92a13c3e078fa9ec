// gpu tier: the grouped GEMM over experts (ops/grouped_gemm.h) on CUDA held to the CPU, for the
// CUDA implementations (one cublasGemmGroupedBatchedEx call, the per-expert loop, the Hopper
// kernel, which declines f32 and the unaligned shapes to the loop, and the mix of the two), forward,
// dgrad and wgrad (accumulating onto a non-zero dw), f32 and bf16, over ragged groups with
// zero-row experts, a single expert, and odd sizes that leave row slices unaligned.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "moecore/ops/grouped_gemm.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

// As in test_gpu_ops.cpp: the CPU and cuBLAS sum the k products in different orders (errors
// ~sqrt(k) * eps relative to the sum of |products|), and bf16 outputs add one rounding.
Tolerance gemm_tolerance(DType out, int64_t k) {
  const double scale = std::sqrt(static_cast<double>(std::max<int64_t>(k, 1)));
  if (out == DType::BF16) return {1e-2 * scale, 1e-2};
  return {2e-6 * scale, 1e-5};
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}
int64_t max_of(const std::vector<int64_t>& v) {
  int64_t m = 0;
  for (int64_t x : v) m = std::max(m, x);
  return m;
}

struct Groups {
  std::string name;
  std::vector<int64_t> rows;
  int64_t n, k;
};

std::vector<Groups> group_cases() {
  return {
      {"ragged_with_empty_experts", {7, 0, 33, 1, 0, 19}, 64, 96},
      {"single_expert", {40}, 48, 80},
      {"one_busy_expert", {0, 0, 25, 0}, 32, 64},
      {"odd_sizes", {3, 11, 0, 5}, 45, 67},  // odd K and N: bf16 row slices 2-byte aligned
  };
}

struct Param {
  DType in, out;  // out differs only for the wgrad of bf16 inputs into f32 gradients
  ops::GroupedGemmImpl impl;
};

std::string param_name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(dtype_name(i.param.in)) + "_to_" + dtype_name(i.param.out) + "_" +
         ops::grouped_gemm_impl_name(i.param.impl);
}

class GroupedGemmGpu : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { previous_ = ops::grouped_gemm_impl(); }
  void TearDown() override { ops::set_grouped_gemm_impl(previous_); }
  ops::GroupedGemmImpl previous_ = ops::GroupedGemmImpl::Grouped;
};

// Forward and dgrad outputs have the input dtype: the bf16 -> f32 parameters are wgrad-only.
class GroupedGemmGpuSameDtype : public GroupedGemmGpu {};

// The CPU always loops; set_grouped_gemm_impl picks the CUDA path under test.
TEST_P(GroupedGemmGpuSameDtype, ForwardAndDgradMatchCpu) {
  MC_REQUIRE_CUDA();
  const Param p = GetParam();
  ops::set_grouped_gemm_impl(p.impl);
  for (const Groups& g : group_cases()) {
    SCOPED_TRACE(g.name);
    const int64_t m = sum(g.rows), e = static_cast<int64_t>(g.rows.size());
    Tensor x = random_tensor({m, g.k}, p.in), w = random_tensor({e, g.n, g.k}, p.in);
    Tensor dout = random_tensor({m, g.n}, p.in);
    expect_cuda_matches_cpu({x, w, dout}, {{{m, g.n}, p.in}, {{m, g.k}, p.in}},
                            [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::grouped_gemm_forward(in[0], in[1], g.rows, out[0]);
                              ops::grouped_gemm_dgrad(in[2], in[1], g.rows, out[1]);
                            },
                            {gemm_tolerance(p.in, g.k), gemm_tolerance(p.in, g.n)});
  }
}

TEST_P(GroupedGemmGpu, WgradAccumulatesOntoNonZeroDwLikeCpu) {
  MC_REQUIRE_CUDA();
  const Param p = GetParam();
  ops::set_grouped_gemm_impl(p.impl);
  for (const Groups& g : group_cases()) {
    SCOPED_TRACE(g.name);
    const int64_t m = sum(g.rows), e = static_cast<int64_t>(g.rows.size());
    Tensor dout = random_tensor({m, g.n}, p.in), x = random_tensor({m, g.k}, p.in);
    Tensor dw0 = random_tensor({e, g.n, g.k}, p.out);  // zero-row experts must keep these values
    expect_cuda_matches_cpu({dout, x, dw0}, {{{e, g.n, g.k}, p.out}},
                            [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              out[0].copy_from(in[2]);
                              ops::grouped_gemm_wgrad(in[0], in[1], g.rows, out[0]);
                            },
                            {gemm_tolerance(p.out, max_of(g.rows))});
  }
}

// accumulate = false (the step's first gradient): dw's old contents (poisoned by the harness,
// on both devices) are ignored and every element is written, zero-row experts with zeros.
TEST_P(GroupedGemmGpu, WgradOverwriteIgnoresOldDwAndZeroesEmptyExperts) {
  MC_REQUIRE_CUDA();
  const Param p = GetParam();
  ops::set_grouped_gemm_impl(p.impl);
  for (const Groups& g : group_cases()) {
    SCOPED_TRACE(g.name);
    const int64_t m = sum(g.rows), e = static_cast<int64_t>(g.rows.size());
    Tensor dout = random_tensor({m, g.n}, p.in), x = random_tensor({m, g.k}, p.in);
    expect_cuda_matches_cpu({dout, x}, {{{e, g.n, g.k}, p.out}},
                            [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::grouped_gemm_wgrad(in[0], in[1], g.rows, out[0], false);
                            },
                            {gemm_tolerance(p.out, max_of(g.rows))});
  }
}

// No rows at all (the Hopper kernel declines a zero dimension): overwriting zeroes every expert,
// from host counts and from device offsets alone, under every implementation.
TEST(GroupedGemmGpuEdge, WgradOverwriteWithNoRowsZeroesEveryExpert) {
  MC_REQUIRE_CUDA();
  const ops::GroupedGemmImpl previous = ops::grouped_gemm_impl();
  for (ops::GroupedGemmImpl impl : {ops::GroupedGemmImpl::Loop, ops::GroupedGemmImpl::Grouped, ops::GroupedGemmImpl::Hopper,
                                    ops::GroupedGemmImpl::Mixed, ops::GroupedGemmImpl::Auto}) {
    ops::set_grouped_gemm_impl(impl);
    for (int device_offsets = 0; device_offsets < 2; ++device_offsets) {
      SCOPED_TRACE(std::string(ops::grouped_gemm_impl_name(impl)) + (device_offsets ? " device offsets" : " host counts"));
      const Tensor dout = Tensor::empty({0, 64}, DType::BF16, Device::cuda(0));
      const Tensor x = Tensor::empty({0, 32}, DType::BF16, Device::cuda(0));
      Tensor dw = poisoned({3, 64, 32}, DType::F32, Device::cuda(0));
      if (device_offsets) {
        const ops::ExpertRows rows({}, Tensor::zeros({4}, DType::I32, Device::cuda(0)));
        ops::grouped_gemm_wgrad(dout, x, rows, dw, false);
      } else {
        ops::grouped_gemm_wgrad(dout, x, std::vector<int64_t>{0, 0, 0}, dw, false);
      }
      for (double v : to_doubles(dw.to(Device::cpu()))) ASSERT_EQ(v, 0.0);
    }
  }
  ops::set_grouped_gemm_impl(previous);
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndImpls, GroupedGemmGpu,
    ::testing::Values(Param{DType::F32, DType::F32, ops::GroupedGemmImpl::Grouped},
                      Param{DType::BF16, DType::BF16, ops::GroupedGemmImpl::Grouped},
                      Param{DType::BF16, DType::F32, ops::GroupedGemmImpl::Grouped},
                      Param{DType::F32, DType::F32, ops::GroupedGemmImpl::Loop},
                      Param{DType::BF16, DType::BF16, ops::GroupedGemmImpl::Loop},
                      Param{DType::BF16, DType::F32, ops::GroupedGemmImpl::Loop},
                      Param{DType::F32, DType::F32, ops::GroupedGemmImpl::Hopper},
                      Param{DType::BF16, DType::BF16, ops::GroupedGemmImpl::Hopper},
                      Param{DType::BF16, DType::F32, ops::GroupedGemmImpl::Hopper},
                      Param{DType::BF16, DType::BF16, ops::GroupedGemmImpl::Mixed},
                      Param{DType::BF16, DType::F32, ops::GroupedGemmImpl::Mixed},
                      Param{DType::BF16, DType::F32, ops::GroupedGemmImpl::Auto}),
    param_name);
INSTANTIATE_TEST_SUITE_P(
    DtypesAndImpls, GroupedGemmGpuSameDtype,
    ::testing::Values(Param{DType::F32, DType::F32, ops::GroupedGemmImpl::Grouped},
                      Param{DType::BF16, DType::BF16, ops::GroupedGemmImpl::Grouped},
                      Param{DType::F32, DType::F32, ops::GroupedGemmImpl::Loop},
                      Param{DType::BF16, DType::BF16, ops::GroupedGemmImpl::Loop},
                      Param{DType::F32, DType::F32, ops::GroupedGemmImpl::Hopper},
                      Param{DType::BF16, DType::BF16, ops::GroupedGemmImpl::Hopper},
                      Param{DType::BF16, DType::BF16, ops::GroupedGemmImpl::Mixed}),
    param_name);

// Zero-row experts keep their wgrad slice exactly (not even rewritten with beta = 1), and an
// all-empty grouping leaves everything unchanged.
TEST(GroupedGemmGpuEdge, EmptyExpertsKeepTheirWgradSliceBitForBit) {
  MC_REQUIRE_CUDA();
  const ops::GroupedGemmImpl previous = ops::grouped_gemm_impl();
  ops::set_grouped_gemm_impl(ops::GroupedGemmImpl::Grouped);
  for (const std::vector<int64_t>& rows : {std::vector<int64_t>{0, 9, 0}, std::vector<int64_t>{0, 0, 0}}) {
    const int64_t m = sum(rows);
    Tensor dout = random_tensor({m, 16}, DType::BF16, Device::cuda(0));
    Tensor x = random_tensor({m, 24}, DType::BF16, Device::cuda(0));
    Tensor dw = random_tensor({3, 16, 24}, DType::F32, Device::cuda(0));
    const std::vector<float> before = dw.to(Device::cpu()).to_vector<float>();
    ops::grouped_gemm_wgrad(dout, x, rows, dw);
    const std::vector<float> after = dw.to(Device::cpu()).to_vector<float>();
    const size_t slice = 16 * 24;
    for (size_t e = 0; e < 3; ++e) {
      if (rows[e] != 0) continue;
      for (size_t i = e * slice; i < (e + 1) * slice; ++i) ASSERT_EQ(after[i], before[i]) << "expert " << e;
    }
    if (m > 0) {  // the busy expert did change
      bool changed = false;
      for (size_t i = slice; i < 2 * slice; ++i) changed = changed || after[i] != before[i];
      EXPECT_TRUE(changed);
    }
  }
  ops::set_grouped_gemm_impl(previous);
}

// The comparison can fail: a CUDA run given another split of the same rows (expert 0 and 1
// swap sizes) must be reported as a mismatch.
TEST(GroupedGemmGpuEdge, AWrongGroupSplitIsCaught) {
  MC_REQUIRE_CUDA();
  const ops::GroupedGemmImpl previous = ops::grouped_gemm_impl();
  ops::set_grouped_gemm_impl(ops::GroupedGemmImpl::Grouped);
  const std::vector<int64_t> rows = {5, 12, 7}, wrong = {12, 5, 7};
  Tensor x = random_tensor({24, 32}, DType::F32), w = random_tensor({3, 16, 32}, DType::F32);
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    expect_cuda_matches_cpu({x, w}, {{{24, 16}, DType::F32}},
                            [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::grouped_gemm_forward(in[0], in[1], in[0].device().is_cuda() ? wrong : rows,
                                                        out[0]);
                            },
                            {gemm_tolerance(DType::F32, 32)});
  }
  int failures = 0;
  for (int i = 0; i < results.size(); ++i) failures += results.GetTestPartResult(i).failed() ? 1 : 0;
  EXPECT_GT(failures, 0) << "a wrong group split on the GPU went unnoticed";
  ops::set_grouped_gemm_impl(previous);
}

TEST(GroupedGemmGpuEdge, F64IsRefusedOnCuda) {
  MC_REQUIRE_CUDA();
  Tensor x = Tensor::zeros({4, 8}, DType::F64, Device::cuda(0)), w = Tensor::zeros({2, 3, 8}, DType::F64, Device::cuda(0));
  Tensor out = Tensor::zeros({4, 3}, DType::F64, Device::cuda(0));
  for (auto impl : {ops::GroupedGemmImpl::Grouped, ops::GroupedGemmImpl::Loop}) {
    const ops::GroupedGemmImpl previous = ops::grouped_gemm_impl();
    ops::set_grouped_gemm_impl(impl);
    EXPECT_THROW(ops::grouped_gemm_forward(x, w, {1, 3}, out), Error) << ops::grouped_gemm_impl_name(impl);
    ops::set_grouped_gemm_impl(previous);
  }
}

}  // namespace
