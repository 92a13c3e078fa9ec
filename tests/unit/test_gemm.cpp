#include <gtest/gtest.h>

#include "moecore/ops/elementwise.h"
#include "moecore/ops/gemm.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {
// Independent reference: naive triple loop in double over the logical op(A), op(B).
std::vector<double> reference(const Tensor& a, const Tensor& b, bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  const std::vector<double> av = to_doubles(a), bv = to_doubles(b);
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) s += (ta ? av[p * m + i] : av[i * k + p]) * (tb ? bv[j * k + p] : bv[p * n + j]);
      c[static_cast<size_t>(i * n + j)] = s;
    }
  return c;
}
}  // namespace

class CpuGemm : public ::testing::TestWithParam<std::tuple<DType, DType, bool, bool>> {};

TEST_P(CpuGemm, MatchesNaiveLoops) {
  const auto [in, out, ta, tb] = GetParam();
  const int64_t m = 13, n = 29, k = 41;
  Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, in);
  Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, in);
  Tensor c = poisoned({m, n}, out);
  ops::gemm(a, b, c, ta, tb);
  ASSERT_TRUE(all_written(c));
  Tensor ref = Tensor::from_vector(reference(a, b, ta, tb, m, n, k), {m, n});
  // bf16 output: one rounding of |C| <= ~k/3, so rtol 1e-2; f32 sums of 41 products: 1e-5.
  EXPECT_TRUE(allclose(c, ref, out == DType::BF16 ? Tolerance{1e-2, 1e-2} : default_tolerance(out)));
}

std::string gemm_case_name(const ::testing::TestParamInfo<std::tuple<DType, DType, bool, bool>>& i) {
  const auto [in, out, ta, tb] = i.param;
  return std::string(dtype_name(in)) + "_to_" + dtype_name(out) + (ta ? "_tA" : "_nA") + (tb ? "_tB" : "_nB");
}

INSTANTIATE_TEST_SUITE_P(F32, CpuGemm,
                         ::testing::Combine(::testing::Values(DType::F32), ::testing::Values(DType::F32),
                                            ::testing::Bool(), ::testing::Bool()),
                         gemm_case_name);
INSTANTIATE_TEST_SUITE_P(F64, CpuGemm,
                         ::testing::Combine(::testing::Values(DType::F64), ::testing::Values(DType::F64),
                                            ::testing::Bool(), ::testing::Bool()),
                         gemm_case_name);
INSTANTIATE_TEST_SUITE_P(Bf16, CpuGemm,
                         ::testing::Combine(::testing::Values(DType::BF16), ::testing::Values(DType::BF16, DType::F32),
                                            ::testing::Bool(), ::testing::Bool()),
                         gemm_case_name);

TEST(Gemm, AlphaBetaAccumulate) {
  Tensor a = random_tensor({6, 5}, DType::F64), b = random_tensor({5, 4}, DType::F64);
  Tensor c0 = random_tensor({6, 4}, DType::F64);
  Tensor c = c0.clone();
  ops::gemm(a, b, c, false, false, 2.0f, 0.5f);
  const std::vector<double> ab = reference(a, b, false, false, 6, 4, 5), c0v = to_doubles(c0);
  std::vector<double> expected(ab.size());
  for (size_t i = 0; i < ab.size(); ++i) expected[i] = 2.0 * ab[i] + 0.5 * c0v[i];
  EXPECT_TRUE(allclose(c, Tensor::from_vector(expected, {6, 4}), default_tolerance(DType::F64)));
}

TEST(Gemm, EmptyInnerDimensionGivesBetaTimesC) {
  Tensor a = Tensor::empty({3, 0}, DType::F32), b = Tensor::empty({0, 2}, DType::F32);
  Tensor c = poisoned({3, 2}, DType::F32);
  ops::gemm(a, b, c, false, false);
  EXPECT_EQ(c.to_vector<float>(), std::vector<float>(6, 0.0f));
}

// A linear layer y = x W^T: the backward GEMMs (dx = dy W, dW = dy^T x) against finite
// differences, through ops::gemm's transpose flags.
TEST(Gemm, LinearLayerGradientsMatchFiniteDifferences) {
  Tensor x = random_tensor({7, 5}, DType::F64), w = random_tensor({3, 5}, DType::F64);
  expect_gradients_match(
      {x, w},
      [](const std::vector<Tensor>& in) {
        Tensor y = Tensor::empty({in[0].size(0), in[1].size(0)}, DType::F64);
        ops::gemm(in[0], in[1], y, false, true);
        return std::vector<Tensor>{y};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& dy) {
        Tensor dx = Tensor::empty(in[0].shape(), DType::F64), dw = Tensor::empty(in[1].shape(), DType::F64);
        ops::gemm(dy[0], in[1], dx, false, false);
        ops::gemm(dy[0], in[0], dw, true, false);
        return std::vector<Tensor>{dx, dw};
      });
}

TEST(Gemm, RejectsBadShapesAndDtypes) {
  Tensor a = Tensor::zeros({4, 3}, DType::F32), b = Tensor::zeros({4, 2}, DType::F32);
  Tensor c = Tensor::zeros({4, 2}, DType::F32);
  try {
    ops::gemm(a, b, c, false, false);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "gemm: inner dimensions differ: op(A) is [4, 3] (trans_a=0), op(B) is [4, 2] (trans_b=0)");
  }
  Tensor cw = Tensor::zeros({3, 3}, DType::F32);
  try {
    ops::gemm(a, b, cw, true, false);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "gemm: C has shape (3, 3); expected (3, 2)");
  }
  Tensor bb = Tensor::zeros({3, 2}, DType::BF16);
  EXPECT_THROW(ops::gemm(a, bb, c, false, false), Error);
  Tensor ci = Tensor::zeros({4, 2}, DType::I32);
  EXPECT_THROW(ops::gemm(a, Tensor::zeros({3, 2}, DType::F32), ci, false, false), Error);
  EXPECT_THROW(ops::gemm(a.transpose(0, 1), b, c, false, false), Error);  // non-contiguous
}
