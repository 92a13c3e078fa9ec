// FP8 dispatch (moe/token_dispatcher.h, Fp8Dispatch): the rows' round trip through E4M3 codes and
// factors, and the claim that the experts' blockwise input quantiser, given the dequantised rows,
// computes the same forward GEMM as quantising the original rows (codes and factors at most a
// power of two apart).
#include <gtest/gtest.h>

#include "moecore/moe/token_dispatcher.h"
#include "moecore/ops/fp8_quant.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

TEST(Fp8Dispatch, TilesRequantiseToTheSameGemm) {
  for (DType dt : {DType::F32, DType::BF16}) {
    const Tensor x = random_tensor({37, 300}, dt, Device::cpu(), -3.0, 3.0);
    const Tensor w = random_tensor({24, 300}, DType::F32);
    const dispatch_detail::Fp8Rows q = dispatch_detail::quantize_dispatch_rows(x, Fp8Dispatch::Tiles);
    EXPECT_EQ(q.codes.dtype(), DType::FP8E4M3);
    EXPECT_EQ(q.scale_inv.shape(), (Shape{37, 3}));
    const Tensor arrived = dispatch_detail::dequantize_dispatch_rows(q.codes, q.scale_inv, Fp8Dispatch::Tiles, {}, dt);
    EXPECT_EQ(arrived.dtype(), dt);
    const ops::Fp8Tensor wq = ops::quantize_blocks(w, ops::Fp8Format::E4M3);
    Tensor direct = Tensor::empty({37, 24}, DType::F32), via = Tensor::empty({37, 24}, DType::F32);
    ops::fp8_gemm(ops::quantize_tiles(x, ops::Fp8Format::E4M3), wq, direct);
    ops::fp8_gemm(ops::quantize_tiles(arrived, ops::Fp8Format::E4M3), wq, via);
    EXPECT_EQ(direct.to_vector<float>(), via.to_vector<float>()) << dtype_name(dt);
  }
}

TEST(Fp8Dispatch, PerTensorChunksKeepTheirSendersFactor) {
  // Two senders with different ranges: each chunk dequantises with its own factor.
  const Tensor a = random_tensor({5, 64}, DType::F32, Device::cpu(), -1.0, 1.0);
  const Tensor b = random_tensor({3, 64}, DType::F32, Device::cpu(), -100.0, 100.0);
  const dispatch_detail::Fp8Rows qa = dispatch_detail::quantize_dispatch_rows(a, Fp8Dispatch::PerTensor);
  const dispatch_detail::Fp8Rows qb = dispatch_detail::quantize_dispatch_rows(b, Fp8Dispatch::PerTensor);
  Tensor codes = Tensor::empty({8, 64}, DType::FP8E4M3);
  codes.slice(0, 0, 5).copy_from(qa.codes);
  codes.slice(0, 5, 8).copy_from(qb.codes);
  const Tensor factors = Tensor::from_vector(
      std::vector<float>{qa.scale_inv.to_vector<float>()[0], qb.scale_inv.to_vector<float>()[0]}, {2});
  const Tensor got = dispatch_detail::dequantize_dispatch_rows(codes, factors, Fp8Dispatch::PerTensor, {5, 3}, DType::F32);
  const std::vector<float> g = got.to_vector<float>(), x = a.to_vector<float>(), y = b.to_vector<float>();
  const std::vector<float> f = factors.to_vector<float>();
  for (size_t i = 0; i < g.size(); ++i) {
    const float want = i < x.size() ? x[i] : y[i - x.size()];
    // One E4M3 rounding: relative 2^-4 for normal codes; below 2^-6 the subnormal codes are 2^-9
    // apart (half of that, times the chunk's factor, is the absolute error).
    const float subnormal_half_step = 0.5f * 0.001953125f * f[i < x.size() ? 0 : 1];
    EXPECT_NEAR(g[i], want, std::abs(want) * 0.0625f + subnormal_half_step) << i;
  }
  // An empty chunk (a rank that sent nothing) takes no rows.
  const Tensor none = dispatch_detail::dequantize_dispatch_rows(qa.codes, Tensor::from_vector(std::vector<float>{
      qa.scale_inv.to_vector<float>()[0], 1.0f}, {2}), Fp8Dispatch::PerTensor, {5, 0}, DType::BF16);
  EXPECT_EQ(none.shape(), (Shape{5, 64}));
}
