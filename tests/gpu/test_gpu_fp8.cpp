// gpu tier: FP8 quantisation on CUDA bit-identical to the CPU (codes and factors: per tensor,
// 1x128 tiles and their 128x1 transposes, 128x128 blocks, both formats, f32 and bf16 inputs,
// ragged edges), and cuBLASLt's FP8 GEMM (per-tensor scale pointers; the VEC128 / BLK128x128
// block-scaling modes) against the CPU emulation of the same operands.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "moecore/ops/fp8_quant.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::ops;
using namespace moecore::testing;

namespace {
Device gpu() { return Device::cuda(0); }

std::vector<uint8_t> code_bytes(const Fp8Tensor& t) {
  const Tensor h = t.data.to(Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.numel());
}

void expect_same(const Fp8Tensor& cpu, const Fp8Tensor& cuda, const char* what) {
  EXPECT_EQ(code_bytes(cpu), code_bytes(cuda)) << what << ": codes differ";
  EXPECT_EQ(to_doubles(cpu.scale_inv), to_doubles(cuda.scale_inv.to(Device::cpu()))) << what << ": factors differ";
}

Fp8Tensor to_gpu(const Fp8Tensor& t) {
  Fp8Tensor g = t;
  g.data = t.data.to(gpu());
  g.scale_inv = t.scale_inv.to(gpu());
  return g;
}
}  // namespace

class GpuFp8Quant : public ::testing::TestWithParam<std::tuple<Fp8Format, DType>> {};

TEST_P(GpuFp8Quant, BitIdenticalToCpu) {
  const auto [f, dt] = GetParam();
  for (const Shape& shape : {Shape{130, 300}, Shape{1, 7}, Shape{256, 128}}) {
    Tensor x = random_tensor(shape, dt, Device::cpu(), -5.0, 5.0);
    if (x.numel() > 3 && dt == DType::F32) {  // an outlier, an exact zero row start, a huge value
      x.data<float>()[0] = 1e6f;
      x.data<float>()[1] = 0.0f;
      x.data<float>()[2] = 3e-12f;
    }
    const Tensor xg = x.to(gpu());
    EXPECT_EQ(amax(x), amax(xg));
    const float scale = fp8_scale_from_amax(amax(x), f, false);
    expect_same(quantize_per_tensor(x, scale, f), quantize_per_tensor(xg, scale, f), "per tensor");
    expect_same(quantize_tiles(x, f), quantize_tiles(xg, f), "1x128 tiles");
    expect_same(quantize_tiles(x, f, true), quantize_tiles(xg, f, true), "128x1 tiles");
    const Fp8Tensor blocks = quantize_blocks(x, f), blocks_gpu = quantize_blocks(xg, f);
    expect_same(blocks, blocks_gpu, "128x128 blocks");
    expect_same(fp8_transpose(blocks), fp8_transpose(blocks_gpu), "transposed blocks");
    EXPECT_EQ(to_doubles(dequantize(blocks)), to_doubles(dequantize(blocks_gpu).to(Device::cpu())));
  }
}

INSTANTIATE_TEST_SUITE_P(All, GpuFp8Quant,
                         ::testing::Combine(::testing::Values(Fp8Format::E4M3, Fp8Format::E5M2),
                                            ::testing::Values(DType::F32, DType::BF16)));

// cuBLASLt's FP8 GEMM against the CPU emulation of the same quantised operands: the sums differ
// only in order (fp32), so 1e-5 of sum |a b| per element.
struct GpuGemmCase {
  const char* name;
  Fp8Scaling sa, sb;
  Fp8Format fa;
  DType out;
};
class GpuFp8Gemm : public ::testing::TestWithParam<GpuGemmCase> {};

TEST_P(GpuFp8Gemm, MatchesTheCpuEmulation) {
  const GpuGemmCase p = GetParam();
  const int64_t m = 256, n = 384, k = 512;
  const Tensor a = random_tensor({m, k}, DType::F32, Device::cpu(), -2.0, 2.0);
  const Tensor b = random_tensor({n, k}, DType::F32, Device::cpu(), -0.1, 0.1);
  auto quant = [](const Tensor& t, Fp8Scaling s, Fp8Format f) {
    return s == Fp8Scaling::PerTensor ? quantize_per_tensor(t, fp8_scale_from_amax(amax(t), f, false), f)
           : s == Fp8Scaling::Tile1x128 ? quantize_tiles(t, f)
                                        : quantize_blocks(t, f);
  };
  const Fp8Tensor qa = quant(a, p.sa, p.fa), qb = quant(b, p.sb, Fp8Format::E4M3);
  Tensor c_cpu = Tensor::empty({m, n}, p.out);
  fp8_gemm(qa, qb, c_cpu);
  Tensor c_gpu = Tensor::empty({m, n}, p.out, gpu());
  fp8_gemm(to_gpu(qa), to_gpu(qb), c_gpu);
  const std::vector<double> want = to_doubles(c_cpu), got = to_doubles(c_gpu.to(Device::cpu()));
  const std::vector<double> ad = to_doubles(dequantize(qa)), bd = to_doubles(dequantize(qb));
  const double rounding = p.out == DType::BF16 ? 1.0 / 128 : 0.0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double abs_sum = 0;
      for (int64_t q = 0; q < k; ++q) abs_sum += std::fabs(ad[i * k + q] * bd[j * k + q]);
      const double w = want[i * n + j];
      // Hopper's FP8 tensor cores add the products with fewer mantissa bits than fp32 before the
      // partial sums reach fp32 (about 14 bits are kept), so cuBLASLt differs from the emulation's
      // fp32 sums by up to ~2^-14 of the sum of |products| (measured: 1.4e-5); a wrong scale or
      // tile is off by O(1).
      ASSERT_LE(std::fabs(got[i * n + j] - w), 1e-4 * abs_sum + rounding * std::fabs(w)) << p.name << " " << i << "," << j;
    }
}

INSTANTIATE_TEST_SUITE_P(
    All, GpuFp8Gemm,
    ::testing::Values(GpuGemmCase{"tensor_e4m3_f32", Fp8Scaling::PerTensor, Fp8Scaling::PerTensor, Fp8Format::E4M3, DType::F32},
                      GpuGemmCase{"tensor_e5m2_bf16", Fp8Scaling::PerTensor, Fp8Scaling::PerTensor, Fp8Format::E5M2, DType::BF16},
                      GpuGemmCase{"tiles_blocks_f32", Fp8Scaling::Tile1x128, Fp8Scaling::Block128, Fp8Format::E4M3, DType::F32},
                      GpuGemmCase{"tiles_blocks_e5m2_bf16", Fp8Scaling::Tile1x128, Fp8Scaling::Block128, Fp8Format::E5M2, DType::BF16},
                      GpuGemmCase{"tiles_tiles_f32", Fp8Scaling::Tile1x128, Fp8Scaling::Tile1x128, Fp8Format::E5M2, DType::F32}),
    [](const auto& i) { return std::string(i.param.name); });
