// gpu tier: the grouped GEMM's few-row forward (ops/gemv_cuda.cu, decoding's expert GEMMs) held
// to the CPU loop, called directly so a silent fallback cannot pass for it; and the public entry
// point under Auto from device offsets and from host counts, which takes it for <= 8 rows. Cases:
// one token's top-2 of 8 experts, 8 rows in one expert (the kernel's limit), rows in the last
// expert only, no rows, N not a multiple of a block's columns, K not a multiple of a warp's
// 256-wide step, and a Mixtral-like K.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "moecore/ops/grouped_gemm.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

struct Case {
  std::string name;
  std::vector<int64_t> rows;
  int64_t n, k;
};

std::vector<int32_t> offsets_of(const std::vector<int64_t>& rows) {
  std::vector<int32_t> off{0};
  for (int64_t r : rows) off.push_back(off.back() + static_cast<int32_t>(r));
  return off;
}

// The CPU sums in another order; the output rounds to bf16 once.
Tolerance tolerance(int64_t k) { return {1e-2 * std::sqrt(static_cast<double>(k)), 1e-2}; }

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {"top2_of_8", {0, 1, 0, 0, 1, 0, 0, 0}, 1000, 2048},
      {"all_rows_one_expert", {0, 8, 0}, 200, 136},
      {"last_expert", {0, 0, 0, 3}, 48, 264},
      {"no_rows", {0, 0}, 64, 64},
      {"mixtral_fc2_like", {2, 0, 3, 0, 1, 0, 0, 2}, 2048, 5632},
  };
  return c;
}

}  // namespace

TEST(GroupedGemv, MatchesCpuLoop) {
  MC_REQUIRE_CUDA();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    int64_t m = 0;
    for (int64_t r : c.rows) m += r;
    const int64_t e = static_cast<int64_t>(c.rows.size());
    Tensor x = random_tensor({m, c.k}, DType::BF16), w = random_tensor({e, c.n, c.k}, DType::BF16);
    Tensor ref = Tensor::zeros({m, c.n}, DType::BF16);
    ops::grouped_gemm_forward(x, w, c.rows, ref);
    const Device dev = Device::cuda(0);
    const Tensor offsets = Tensor::from_vector(offsets_of(c.rows), {e + 1}).to(dev);
    Tensor out = poisoned({m, c.n}, DType::BF16, dev);
    ASSERT_TRUE(ops::cuda::grouped_gemv_forward(x.to(dev), w.to(dev), offsets, out)) << "the kernel did not take the case";
    const Tensor got = out.to(Device::cpu());
    EXPECT_TRUE(all_written(got));
    EXPECT_TRUE(allclose(got, ref, tolerance(c.k)));

    // The public forward from device offsets alone under Auto (the default) gives the same.
    ops::set_grouped_gemm_impl(ops::GroupedGemmImpl::Auto);
    Tensor out2 = poisoned({m, c.n}, DType::BF16, dev);
    ops::grouped_gemm_forward(x.to(dev), w.to(dev), ops::ExpertRows({}, offsets), out2);
    EXPECT_TRUE(allclose(out2.to(Device::cpu()), got, {0.0, 0.0})) << "public entry point, device offsets";
    // ... and from host counts (the same kernel: host and device rows give the same bits).
    Tensor out3 = poisoned({m, c.n}, DType::BF16, dev);
    ops::grouped_gemm_forward(x.to(dev), w.to(dev), c.rows, out3);
    EXPECT_TRUE(allclose(out3.to(Device::cpu()), got, {0.0, 0.0})) << "public entry point, host counts";
  }
}

TEST(GroupedGemv, DeclinesWhatItCannotDo) {
  MC_REQUIRE_CUDA();
  const Device dev = Device::cuda(0);
  const Tensor offsets = Tensor::from_vector(std::vector<int32_t>{0, 9}, {2}).to(dev);
  Tensor w = Tensor::zeros({1, 16, 64}, DType::BF16, dev);
  Tensor x9 = Tensor::zeros({9, 64}, DType::BF16, dev), out9 = Tensor::zeros({9, 16}, DType::BF16, dev);
  EXPECT_FALSE(ops::cuda::grouped_gemv_forward(x9, w, offsets, out9)) << "more rows than the kernel's limit";
  const Tensor off2 = Tensor::from_vector(std::vector<int32_t>{0, 2}, {2}).to(dev);
  Tensor wk = Tensor::zeros({1, 16, 60}, DType::BF16, dev), xk = Tensor::zeros({2, 60}, DType::BF16, dev);
  Tensor outk = Tensor::zeros({2, 16}, DType::BF16, dev);
  EXPECT_FALSE(ops::cuda::grouped_gemv_forward(xk, wk, off2, outk)) << "K not a multiple of 8";
  Tensor wf = Tensor::zeros({1, 16, 64}, DType::F32, dev), xf = Tensor::zeros({2, 64}, DType::F32, dev);
  Tensor outf = Tensor::zeros({2, 16}, DType::F32, dev);
  EXPECT_FALSE(ops::cuda::grouped_gemv_forward(xf, wf, off2, outf)) << "f32";
}
