// gpu tier: FP8 quantisation on CUDA bit-identical to the CPU (codes and factors: per tensor,
// 1x128 tiles and their 128x1 transposes, 128x128 blocks, both formats, f32 and bf16 inputs,
// ragged edges; block amaxes and blocks with given amaxes), and cuBLASLt's FP8 GEMM (per-tensor scale pointers; the VEC128 / BLK128x128
// block-scaling modes) against the CPU emulation of the same operands; the per-tensor scaling
// state kept on the device against the CPU's host arithmetic.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "moecore/model/fp8_linear.h"
#include "moecore/ops/elementwise.h"
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
  // ragged edges; the kernels' vector paths (whole 64 x 64 code tiles, 8-element rows) at 512 x 1024
  for (const Shape& shape : {Shape{130, 300}, Shape{1, 7}, Shape{256, 128}, Shape{512, 1024}, Shape{200, 264}}) {
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
    // --fp8-param-gather's pieces: block amaxes, and blocks quantised with given amaxes
    const Tensor block_amaxes = block_amax(x);
    EXPECT_EQ(to_doubles(block_amaxes), to_doubles(block_amax(xg).to(Device::cpu())));
    Tensor given = block_amaxes.clone();
    for (int64_t i = 0; i < given.numel(); ++i) given.data<float>()[i] *= 1.5f;  // as if another rank's piece were larger
    expect_same(quantize_blocks(x, given, f), quantize_blocks(xg, given.to(gpu()), f), "128x128 blocks, given amaxes");
    expect_same(fp8_transpose(blocks), fp8_transpose(blocks_gpu), "transposed blocks");
    EXPECT_EQ(to_doubles(dequantize(blocks)), to_doubles(dequantize(blocks_gpu).to(Device::cpu())));
  }
}

// The CUDA quantisers encode with the hardware's conversion (cvt.rn.satfinite): every bf16 value
// (NaNs, infinities, subnormals, both signs; x 1 and x 2^-7, which moves values across the fp8
// subnormal range and the saturation edge) and random f32 bit patterns give the CPU's codes.
TEST_P(GpuFp8Quant, EveryBf16ValueAndRandomF32BitsEncodeAsOnTheCpu) {
  const auto [f, dt] = GetParam();
  Tensor x = Tensor::empty({256, 256}, dt);
  std::mt19937 rng(7);
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (dt == DType::BF16) x.data<bf16>()[i] = bf16::from_bits(static_cast<uint16_t>(i));
    else x.data<float>()[i] = bits_float(static_cast<uint32_t>(rng()));
  }
  const Tensor xg = x.to(gpu());
  const Tensor xf = cast_to(x, DType::F32);
  for (float scale : {1.0f, 0.0078125f}) {
    const std::vector<uint8_t> cpu = code_bytes(quantize_per_tensor(x, scale, f)),
                               cuda = code_bytes(quantize_per_tensor(xg, scale, f));
    int shown = 0, differ = 0;
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (cpu[i] == cuda[i]) continue;
      ++differ;
      if (shown++ < 8)
        ADD_FAILURE() << "scale " << scale << ": x bits 0x" << std::hex << float_bits(xf.data<float>()[i]) << " -> cpu 0x"
                      << int(cpu[i]) << ", cuda 0x" << int(cuda[i]) << std::dec;
    }
    EXPECT_EQ(differ, 0) << "codes that differ at scale " << scale;
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
  // whole tiles, then M and K not multiples of 16 (fp8_gemm pads both: an expert's ragged rows as a
  // forward's M and as a wgrad's K)
  for (const auto& [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{256, 384, 512}, {37, 384, 200}, {300, 64, 37}}) {
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
      // fp32 sums by a few 2^-14 of the sum of |products|: 1.4e-5 measured at K = 512, up to
      // 1.15e-4 at K = 37 (one or two instructions' short sums carry all of it); a wrong scale,
      // tile or padding is off by O(1).
      ASSERT_LE(std::fabs(got[i * n + j] - w), 3e-4 * abs_sum + rounding * std::fabs(w))
          << p.name << " " << m << "x" << n << "x" << k << " " << i << "," << j;
    }
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

// The per-tensor scaling state kept on the device (fp8_quant.h): the amax tensor, the quantiser
// reading its scale there (from an amax, from a stored scale, 0 meaning 1), record_amax and the
// delayed update equal the CPU's (the host arithmetic) bit for bit.
TEST(GpuFp8DeviceScale, QuantiserEqualsTheHostScaleOne) {
  for (const DType dt : {DType::F32, DType::BF16}) {
    Tensor x = random_tensor({130, 300}, dt, Device::cpu(), -5.0, 5.0);
    const Tensor xg = x.to(gpu());
    const Tensor a = amax_tensor(x), ag = amax_tensor(xg);
    EXPECT_EQ(to_doubles(a), to_doubles(ag.to(Device::cpu())));
    for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
      const Fp8Tensor host_scale = quantize_per_tensor(x, fp8_scale_from_amax(amax(x), f, false), f);
      expect_same(host_scale, quantize_per_tensor(xg, ag, Fp8ScaleFrom::Amax, f), "device amax");
      for (float s : {0.0f, 3.75f, 1e-3f}) {
        const Tensor src = Tensor::from_vector(std::vector<float>{s}, {1});
        expect_same(quantize_per_tensor(x, src, Fp8ScaleFrom::Stored, f),
                    quantize_per_tensor(xg, src.to(gpu()), Fp8ScaleFrom::Stored, f), "stored scale");
      }
    }
  }
}

TEST(GpuFp8DeviceScale, HistoryAndDelayedUpdateEqualTheCpu) {
  for (bool use_max : {true, false}) {
    for (int64_t margin : {0, 2}) {
      const int64_t rows = 9, len = 5;
      Tensor h = random_tensor({rows, len}, DType::F32, Device::cpu(), 0.0, 40.0);
      h.data<float>()[1 * len] = 0.0f;       // an amax of 0: scale kept
      h.data<float>()[2 * len + 3] = NAN;    // a NaN in the history
      h.data<float>()[4 * len] = INFINITY;   // an infinite amax
      h.data<float>()[5 * len + 1] = 1e-38f;  // tiny values
      Tensor scale = random_tensor({rows}, DType::F32, Device::cpu(), 0.5, 3.0);
      scale.data<float>()[1] = 0.0f;  // none yet
      Tensor hg = h.to(gpu()), sg = scale.to(gpu());
      const Tensor x = random_tensor({7, 33}, DType::BF16, Device::cpu(), -60.0, 60.0);
      for (int64_t row : {0, 3, 8}) {
        record_amax(x, h, row);
        record_amax(x.to(gpu()), hg, row);
      }
      Tensor newest = Tensor::empty({rows}, DType::F32), newest_g = Tensor::empty({rows}, DType::F32, gpu());
      history_newest(h, newest);
      history_newest(hg, newest_g);
      EXPECT_EQ(to_doubles(newest), to_doubles(newest_g.to(Device::cpu())));
      DelayedScalingUpdate u;
      u.grad_fp8_max = 57344.0f;
      u.amax_compute_max = use_max;
      u.margin = margin;
      delayed_scaling_update(h, scale, newest, u);
      delayed_scaling_update(hg, sg, newest_g, u);
      auto bits = [](const Tensor& t) {  // NaN-safe comparison
        const std::vector<float> v = t.to(Device::cpu()).to_vector<float>();
        std::vector<uint32_t> b;
        for (float f : v) b.push_back(std::isnan(f) ? 0x7fc00000u : float_bits(f));
        return b;
      };
      EXPECT_EQ(bits(h), bits(hg)) << "histories, max " << use_max << " margin " << margin;
      EXPECT_EQ(bits(scale), bits(sg)) << "scales, max " << use_max << " margin " << margin;
    }
  }
}

// A wgrad over rows that are not a multiple of 16 (an expert's share) on the GPU: the zero-padded
// rows give the CPU emulation's result (model/fp8_linear.h).
TEST(GpuFp8DeviceScale, Fp8LinearWgradOverRaggedRows) {
  for (Fp8Config::Recipe recipe : {Fp8Config::Recipe::Tensorwise, Fp8Config::Recipe::Blockwise}) {
    Fp8Config cfg;
    cfg.enabled = true;
    cfg.recipe = recipe;
    Fp8Context ctx(cfg);
    ParamStore store_cpu(Device::cpu(), DType::F32, DType::F32, 1), store_gpu(gpu(), DType::F32, DType::F32, 1);
    const Fp8Linear lin_cpu(ctx, store_cpu, "l", 1, nullptr, 64, 32), lin_gpu(ctx, store_gpu, "l", 1, nullptr, 64, 32);
    const Tensor dy = random_tensor({37, 32}, DType::F32, Device::cpu(), -1.0, 1.0);
    const Tensor x = random_tensor({37, 64}, DType::F32, Device::cpu(), -2.0, 2.0);
    Tensor dw = Tensor::zeros({32, 64}, DType::F32), dw_g = Tensor::zeros({32, 64}, DType::F32, gpu());
    lin_cpu.wgrad(dy, x, dw, 0.0f);
    lin_gpu.wgrad(dy.to(gpu()), x.to(gpu()), dw_g, 0.0f);
    const std::vector<double> want = to_doubles(dw), got = to_doubles(dw_g.to(Device::cpu()));
    // cuBLASLt vs the emulation: summation order and the tensor cores' ~14-bit partial sums (sums of
    // |products| up to ~74 here: < 1e-2); a padding or layout error is O(1).
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-2) << i;
  }
}
