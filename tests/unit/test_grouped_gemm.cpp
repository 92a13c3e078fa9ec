// Grouped GEMM over experts: equals a per-expert loop of ops::gemm and the plain formula.
#include <gtest/gtest.h>

#include <cmath>

#include "moecore/ops/gemm.h"
#include "moecore/ops/grouped_gemm.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

// Groups with empty experts at the start, middle and end.
const std::vector<int64_t> kGroups = {0, 3, 0, 5, 2, 0};
constexpr int64_t kM = 10, kN = 6, kK = 7, kE = 6;

Tolerance tol_for(DType t, int64_t sum_len) {
  // Sums of sum_len products of U(-1,1) in another order: atol grows like sqrt(len).
  if (t == DType::F64) return default_tolerance(t);
  if (t == DType::BF16) return {1e-2 * std::sqrt(double(sum_len)), 1e-2};
  return {2e-6 * std::sqrt(double(sum_len)), 1e-5};
}

// Expert slice of an [E, N, K] tensor, as a fresh contiguous copy.
Tensor expert_copy(const Tensor& w, int64_t e) { return w.slice(0, e, e + 1).view({w.size(1), w.size(2)}).clone(); }

}  // namespace

TEST(GroupedGemm, EqualsPerExpertLoopOfGemm) {
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    SCOPED_TRACE(dtype_name(t));
    const DType wg = t == DType::BF16 ? DType::F32 : t;  // weight gradients in fp32 for bf16
    Tensor x = random_tensor({kM, kK}, t), w = random_tensor({kE, kN, kK}, t);
    Tensor dout = random_tensor({kM, kN}, t), dw0 = random_tensor({kE, kN, kK}, wg);
    Tensor out = poisoned({kM, kN}, t), dx = poisoned({kM, kK}, t), dw = dw0.clone();
    ops::grouped_gemm_forward(x, w, kGroups, out);
    ops::grouped_gemm_dgrad(dout, w, kGroups, dx);
    ops::grouped_gemm_wgrad(dout, x, kGroups, dw);
    ASSERT_TRUE(all_written(out));
    ASSERT_TRUE(all_written(dx));

    // The loop: each expert on its own copies.
    int64_t begin = 0;
    for (int64_t e = 0; e < kE; ++e) {
      const int64_t end = begin + kGroups[static_cast<size_t>(e)];
      const Tensor we = expert_copy(w, e), dw0e = expert_copy(dw0, e), dwe = expert_copy(dw, e);
      if (end == begin) {
        EXPECT_TRUE(allclose(dwe, dw0e, {0, 0})) << "expert " << e << " with no rows changed its dw";
        continue;
      }
      const Tensor xe = x.slice(0, begin, end).clone(), de = dout.slice(0, begin, end).clone();
      Tensor oe = Tensor::empty({end - begin, kN}, t), dxe = Tensor::empty({end - begin, kK}, t);
      Tensor acc = dw0e.clone();
      ops::gemm(xe, we, oe, false, true);
      ops::gemm(de, we, dxe, false, false);
      ops::gemm(de, xe, acc, true, false, 1.0f, 1.0f);
      EXPECT_TRUE(allclose(out.slice(0, begin, end).clone(), oe, tol_for(t, kK))) << "forward, expert " << e;
      EXPECT_TRUE(allclose(dx.slice(0, begin, end).clone(), dxe, tol_for(t, kN))) << "dgrad, expert " << e;
      EXPECT_TRUE(allclose(dwe, acc, tol_for(wg, end - begin))) << "wgrad, expert " << e;
      begin = end;
    }
  }
}

TEST(GroupedGemm, ForwardMatchesFormula) {
  Tensor x = random_tensor({kM, kK}, DType::F64), w = random_tensor({kE, kN, kK}, DType::F64);
  Tensor out = poisoned({kM, kN}, DType::F64);
  ops::grouped_gemm_forward(x, w, kGroups, out);
  const auto xv = to_doubles(x), wv = to_doubles(w);
  std::vector<double> want(static_cast<size_t>(kM * kN));
  int64_t row = 0;
  for (int64_t e = 0; e < kE; ++e)
    for (int64_t i = 0; i < kGroups[static_cast<size_t>(e)]; ++i, ++row)
      for (int64_t n = 0; n < kN; ++n) {
        double s = 0;
        for (int64_t c = 0; c < kK; ++c) s += xv[row * kK + c] * wv[(e * kN + n) * kK + c];
        want[static_cast<size_t>(row * kN + n)] = s;
      }
  EXPECT_TRUE(allclose(out, Tensor::from_vector(want, {kM, kN}), default_tolerance(DType::F64)));
}

TEST(GroupedGemm, GradientsMatchFiniteDifferences) {
  GradCheckOptions opt;
  opt.max_elements = 1000;
  expect_gradients_match(
      {random_tensor({kM, kK}, DType::F64), random_tensor({kE, kN, kK}, DType::F64)},
      [](const std::vector<Tensor>& in) {
        Tensor out = Tensor::empty({kM, kN}, DType::F64);
        ops::grouped_gemm_forward(in[0], in[1], kGroups, out);
        return std::vector<Tensor>{out};
      },
      [](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
        Tensor dx = poisoned({kM, kK}, DType::F64), dw = Tensor::zeros({kE, kN, kK}, DType::F64);
        ops::grouped_gemm_dgrad(dout[0], in[1], kGroups, dx);
        ops::grouped_gemm_wgrad(dout[0], in[0], kGroups, dw);
        return std::vector<Tensor>{dx, dw};
      },
      opt);
}

TEST(GroupedGemm, AllRowsInOneExpertAndNoRows) {
  Tensor x = random_tensor({kM, kK}, DType::F32), w = random_tensor({3, kN, kK}, DType::F32);
  Tensor out = poisoned({kM, kN}, DType::F32), ref = Tensor::empty({kM, kN}, DType::F32);
  ops::grouped_gemm_forward(x, w, {0, kM, 0}, out);
  ops::gemm(x, expert_copy(w, 1), ref, false, true);
  EXPECT_TRUE(allclose(out, ref, tol_for(DType::F32, kK)));
  // An empty permuted buffer (a rank that received no tokens): nothing to do, nothing raised.
  Tensor x0 = Tensor::empty({0, kK}, DType::F32), o0 = Tensor::empty({0, kN}, DType::F32);
  Tensor dw = random_tensor({3, kN, kK}, DType::F32), dw_before = dw.clone();
  ops::grouped_gemm_forward(x0, w, {0, 0, 0}, o0);
  ops::grouped_gemm_wgrad(o0, x0, {0, 0, 0}, dw);
  EXPECT_TRUE(allclose(dw, dw_before, {0, 0}));
}

TEST(GroupedGemm, RejectsBadArguments) {
  Tensor x = Tensor::zeros({kM, kK}, DType::F32), w = Tensor::zeros({kE, kN, kK}, DType::F32);
  Tensor out = Tensor::zeros({kM, kN}, DType::F32);
  try {
    ops::grouped_gemm_forward(x, w, {1, 2, 3, 4, 5, 6}, out);
    FAIL() << "wrong row total accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "grouped_gemm_forward: rows_per_group sums to 21 but the permuted buffer has 10 rows");
  }
  EXPECT_THROW(ops::grouped_gemm_forward(x, w, {10}, out), Error);                  // one entry per expert
  EXPECT_THROW(ops::grouped_gemm_forward(x, w, {12, -2, 0, 0, 0, 0}, out), Error);  // negative
  EXPECT_THROW(ops::grouped_gemm_forward(x, Tensor::zeros({kE, kN, kK + 1}, DType::F32), kGroups, out), Error);
  EXPECT_THROW(ops::grouped_gemm_forward(x, w.view({kE * kN, kK}), kGroups, out), Error);
  Tensor dx = Tensor::zeros({kM, kK}, DType::F32);
  EXPECT_THROW(ops::grouped_gemm_dgrad(x, w, kGroups, dx), Error);  // dout has K columns, not N
  Tensor dw = Tensor::zeros({kE, kN, kK}, DType::BF16);
  EXPECT_THROW(ops::grouped_gemm_wgrad(out, x, kGroups, dw), Error);  // f32 inputs, bf16 dw
}

// ExpertRows: device offsets alone (on the CPU: copied back and run as host counts) give the same
// results as the host counts; bad offsets are named.
TEST(GroupedGemm, ExpertRowsFromOffsetsEqualHostCounts) {
  const Tensor x = random_tensor({kM, kK}, DType::F32), w = random_tensor({kE, kN, kK}, DType::F32);
  const Tensor dout = random_tensor({kM, kN}, DType::F32);
  std::vector<int32_t> off = {0};
  for (int64_t g : kGroups) off.push_back(off.back() + static_cast<int32_t>(g));
  const ops::ExpertRows rows{{}, Tensor::from_vector(off, {kE + 1})};
  EXPECT_EQ(rows.counts(), kGroups);
  Tensor out_ref = Tensor::zeros({kM, kN}, DType::F32), out = Tensor::zeros({kM, kN}, DType::F32);
  Tensor dx_ref = Tensor::zeros({kM, kK}, DType::F32), dx = Tensor::zeros({kM, kK}, DType::F32);
  Tensor dw_ref = random_tensor({kE, kN, kK}, DType::F32), dw = dw_ref.clone();
  ops::grouped_gemm_forward(x, w, kGroups, out_ref);
  ops::grouped_gemm_dgrad(dout, w, kGroups, dx_ref);
  ops::grouped_gemm_wgrad(dout, x, kGroups, dw_ref);
  ops::grouped_gemm_forward(x, w, rows, out);
  ops::grouped_gemm_dgrad(dout, w, rows, dx);
  ops::grouped_gemm_wgrad(dout, x, rows, dw);
  EXPECT_EQ(out.to_vector<float>(), out_ref.to_vector<float>());
  EXPECT_EQ(dx.to_vector<float>(), dx_ref.to_vector<float>());
  EXPECT_EQ(dw.to_vector<float>(), dw_ref.to_vector<float>());
  try {
    ops::grouped_gemm_forward(x, w, ops::ExpertRows{{}, Tensor::from_vector(off, {kE + 1}).slice(0, 0, kE)}, out);
    FAIL() << "offsets of the wrong length accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("grouped_gemm_forward: argument 'rows.offsets' has shape (6); expected (7)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ops::grouped_gemm_forward(x, w, ops::ExpertRows{}, out), Error);  // neither counts nor offsets
  EXPECT_THROW(ops::grouped_gemm_forward(x, w, ops::ExpertRows{{}, Tensor::zeros({kE + 1}, DType::I64)}, out), Error);
}
