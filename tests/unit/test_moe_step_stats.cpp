// The MoE step statistics packed, reduced and applied on the device (ops/moe_step_stats.h; the
// MoE layers' device path of a training step) against the host arithmetic they replace
// (MoeStats::finish_step and reduce_moe_step_stats): the same losses, counts and expert bias, bit
// for bit, on CPU tensors (the CUDA kernels run the same double arithmetic in the same order).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "moecore/core/float_formats.h"
#include "moecore/ops/moe_step_stats.h"

using namespace moecore;

TEST(MoeStepStats, PackAndFinishMatchTheHostArithmetic) {
  const int64_t e = 5;
  const double aux_coeff = 1e-2, z_coeff = 1e-3, rate = 1e-3, dp = 3.0;
  const Tensor aux = Tensor::from_vector(std::vector<float>{0.0731f}, {1});
  const Tensor z = Tensor::from_vector(std::vector<bf16>{bf16(2.4f)}, {1});
  const Tensor counts = Tensor::from_vector(std::vector<int64_t>{7, 0, 12, 9, 4, 0, 0}, {e + 2});
  const std::vector<double> host_part = {1, 2, 0, 0, 3};
  Tensor packed = Tensor::empty({e + 4}, DType::F64, Device::cpu());
  ops::pack_moe_step_stats(aux, z, counts, Tensor::from_vector(host_part, {e}), aux_coeff, z_coeff, packed);
  // The host: losses read as f32 and divided by their coefficients, counts summed.
  std::vector<double> want = {0.0 + static_cast<double>(0.0731f) / aux_coeff,
                              0.0 + static_cast<double>(static_cast<float>(bf16(2.4f))) / z_coeff};
  const std::vector<int64_t> c = {7, 0, 12, 9, 4};
  for (int64_t i = 0; i < e; ++i) want.push_back(host_part[static_cast<size_t>(i)] + static_cast<double>(c[static_cast<size_t>(i)]));
  want.push_back(0.0);
  want.push_back(0.0);
  EXPECT_EQ(packed.to_vector<double>(), want);

  // Averaged over DP, then the bias update: b += rate * sign(mean - c).
  std::vector<float> b0 = {0.25f, -0.5f, 1e-4f, 0.0f, 3.0f};
  Tensor bias = Tensor::from_vector(b0, {e});
  ops::finish_moe_step_stats(packed, dp, bias, rate);
  const std::vector<double> got = packed.to_vector<double>();
  EXPECT_EQ(got[0], want[0] / dp);
  EXPECT_EQ(got[1], want[1] / dp);
  double mean = 0;
  for (int64_t i = 0; i < e; ++i) mean += want[static_cast<size_t>(2 + i)];
  mean /= static_cast<double>(e);
  for (int64_t i = 0; i < e; ++i) {
    const double d = mean - want[static_cast<size_t>(2 + i)];
    const float expected = static_cast<float>(static_cast<double>(b0[static_cast<size_t>(i)]) +
                                              rate * (d > 0 ? 1.0 : (d < 0 ? -1.0 : 0.0)));
    EXPECT_EQ(bias.to_vector<float>()[static_cast<size_t>(i)], expected) << "expert " << i;
  }
}

TEST(MoeStepStats, MissingPartsCountZeroAndFlagsPassThrough) {
  const int64_t e = 3;
  Tensor packed = Tensor::empty({e + 4}, DType::F64, Device::cpu());
  const Tensor counts = Tensor::from_vector(std::vector<int64_t>{1, 2, 3, 1, 0}, {e + 2});
  ops::pack_moe_step_stats(Tensor(), Tensor(), counts, Tensor(), 1e-2, 1e-3, packed);
  EXPECT_EQ(packed.to_vector<double>(), (std::vector<double>{0, 0, 1, 2, 3, 1, 0}));
  Tensor no_bias;
  ops::finish_moe_step_stats(packed, 1.0, no_bias, 1e-3);
  EXPECT_EQ(packed.to_vector<double>(), (std::vector<double>{0, 0, 1, 2, 3, 1, 0}));
  Tensor wrong = Tensor::empty({e + 3}, DType::F64, Device::cpu());
  EXPECT_THROW(ops::pack_moe_step_stats(Tensor(), Tensor(), counts, Tensor(), 1e-2, 1e-3, wrong), Error);
}
