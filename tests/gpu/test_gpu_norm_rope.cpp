// gpu tier: CUDA RMSNorm, LayerNorm and RoPE held to their CPU ops (op_harness), f32 and bf16.
#include <gtest/gtest.h>

#include <cmath>

#include "moecore/ops/norm.h"
#include "moecore/ops/rope.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

const Device kCuda = Device::cuda(0);

// Tolerances for the norms. Forward/dx: per-row sums of H terms in another order (fp32 on the
// GPU, per thread then a tree; fp32 sequential on the CPU) move rstd and the row means by a
// few 1e-7 relative; y and dx are O(1), so f32 gets 1e-5 absolute and 1e-4 relative, bf16 its
// default (one bf16 rounding may flip). mean/rstd are f32 for both dtypes: 1e-5.
// dweight/dbias are sums over `rows` O(1) terms: double on the CPU, two-level fp32 on the GPU;
// the rounding error grows like sqrt(rows) * 6e-8 * |term|, so atol 2e-5 * sqrt(rows).
Tolerance data_tol(DType t) { return t == DType::F32 ? Tolerance{1e-5, 1e-4} : default_tolerance(t); }
Tolerance param_grad_tol(int64_t rows) { return {2e-5 * std::sqrt(static_cast<double>(rows)), 1e-5}; }
const Tolerance kStatTol{1e-5, 1e-5};

struct NormCase {
  int64_t rows, H;
};
// H: warp per row (64), block of 256 (1000, not a multiple of 8), block of 512 (8200). bf16
// with H a multiple of 8 up to 8192 takes the vectorised kernels: 1024, 2040 (255 threads of 8
// columns: a partial warp), 4096 and 8192 (the largest: blocks of 1024 threads). Row counts
// beyond the backward's worker count (4096 warps, 512 blocks) make workers loop.
const NormCase kNormCases[] = {{37, 64},    {5000, 64},  {37, 1000}, {700, 1000}, {19, 4096},
                               {600, 4096}, {700, 1024}, {600, 2040}, {9, 8200},  {600, 8192}};

}  // namespace

class GpuNorm : public ::testing::TestWithParam<DType> {};

TEST_P(GpuNorm, RMSNormForwardAndBackwardMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  for (const NormCase& c : kNormCases) {
    Tensor x = random_tensor({c.rows, c.H}, t, Device::cpu(), -2, 2), w = random_tensor({c.H}, t);
    Tensor dy = random_tensor({c.rows, c.H}, t), dw0 = random_tensor({c.H}, DType::F32);
    expect_cuda_matches_cpu(
        {x, w, dy, dw0}, {{{c.rows, c.H}, t}, {{c.rows}, DType::F32}, {{c.rows, c.H}, t}, {{c.H}, DType::F32}},
        [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
          ops::rmsnorm_forward(in[0], in[1], 1e-5, out[0], out[1]);
          out[3].copy_from(in[3]);  // dweight accumulates onto a random start
          ops::rmsnorm_backward(in[0], in[1], out[1], in[2], out[2], out[3]);
        },
        {data_tol(t), kStatTol, data_tol(t), param_grad_tol(c.rows)});
    if (HasFailure()) FAIL() << "rows " << c.rows << " H " << c.H;
  }
  // A weight 8 bytes past a 16-byte boundary (a parameter inside a flat buffer): the scalar
  // kernels, same results.
  const int64_t rows = 300, H = 1024;
  Tensor x = random_tensor({rows, H}, t, Device::cpu(), -2, 2), w = random_tensor({H + 4}, t);
  Tensor dy = random_tensor({rows, H}, t), dw0 = random_tensor({H}, DType::F32);
  expect_cuda_matches_cpu(
      {x, w, dy, dw0}, {{{rows, H}, t}, {{rows}, DType::F32}, {{rows, H}, t}, {{H}, DType::F32}},
      [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
        const Tensor weight = in[1].slice(0, 4, in[1].size(0));
        ops::rmsnorm_forward(in[0], weight, 1e-5, out[0], out[1]);
        out[3].copy_from(in[3]);
        ops::rmsnorm_backward(in[0], weight, out[1], in[2], out[2], out[3]);
      },
      {data_tol(t), kStatTol, data_tol(t), param_grad_tol(rows)});
}

TEST_P(GpuNorm, LayerNormForwardAndBackwardMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  for (const NormCase& c : kNormCases) {
    Tensor x = random_tensor({c.rows, c.H}, t, Device::cpu(), -1, 3), w = random_tensor({c.H}, t);
    Tensor b = random_tensor({c.H}, t), dy = random_tensor({c.rows, c.H}, t);
    Tensor dw0 = random_tensor({c.H}, DType::F32), db0 = random_tensor({c.H}, DType::F32);
    expect_cuda_matches_cpu(
        {x, w, b, dy, dw0, db0},
        {{{c.rows, c.H}, t},
         {{c.rows}, DType::F32},
         {{c.rows}, DType::F32},
         {{c.rows, c.H}, t},
         {{c.H}, DType::F32},
         {{c.H}, DType::F32}},
        [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
          ops::layernorm_forward(in[0], in[1], in[2], 1e-5, out[0], out[1], out[2]);
          out[4].copy_from(in[4]);
          out[5].copy_from(in[5]);
          ops::layernorm_backward(in[0], in[1], out[1], out[2], in[3], out[3], out[4], out[5]);
        },
        {data_tol(t), kStatTol, kStatTol, data_tol(t), param_grad_tol(c.rows), param_grad_tol(c.rows)});
    if (HasFailure()) FAIL() << "rows " << c.rows << " H " << c.H;
  }
}

// No atomics: the same inputs give the same bits, and a second backward exactly doubles.
TEST_P(GpuNorm, ParameterGradientsAreReproducibleAndAccumulate) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  for (int64_t H : {64, 1000, 1024}) {
    const int64_t rows = 3000;
    Tensor x = random_tensor({rows, H}, t, kCuda), w = random_tensor({H}, t, kCuda), b = random_tensor({H}, t, kCuda);
    Tensor dy = random_tensor({rows, H}, t, kCuda), y = Tensor::empty({rows, H}, t, kCuda);
    Tensor dx = Tensor::empty({rows, H}, t, kCuda);
    Tensor mean = Tensor::empty({rows}, DType::F32, kCuda), rstd = Tensor::empty({rows}, DType::F32, kCuda);
    ops::layernorm_forward(x, w, b, 1e-5, y, mean, rstd);
    Tensor dw1 = Tensor::zeros({H}, DType::F32, kCuda), db1 = Tensor::zeros({H}, DType::F32, kCuda);
    Tensor dw2 = Tensor::zeros({H}, DType::F32, kCuda), db2 = Tensor::zeros({H}, DType::F32, kCuda);
    ops::layernorm_backward(x, w, mean, rstd, dy, dx, dw1, db1);
    ops::layernorm_backward(x, w, mean, rstd, dy, dx, dw2, db2);
    EXPECT_EQ(dw1.to_vector<float>(), dw2.to_vector<float>()) << "H " << H;
    EXPECT_EQ(db1.to_vector<float>(), db2.to_vector<float>()) << "H " << H;
    ops::layernorm_backward(x, w, mean, rstd, dy, dx, dw2, db2);
    const std::vector<float> once = dw1.to_vector<float>(), twice = dw2.to_vector<float>();
    for (int64_t h = 0; h < H; ++h) ASSERT_EQ(twice[h], 2 * once[h]) << "H " << H << " h " << h;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuNorm, ::testing::Values(DType::F32, DType::BF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

// ---- RoPE -----------------------------------------------------------------------------
// Both backends take cos/sin from a table computed in double and rounded to float, and rotate
// with the same IEEE operations (the kernel forbids fused multiply-adds). So f32 results are
// equal but where the device's double cos/sin and glibc's round to different floats (at most
// one float ulp, ~6e-8 of a value <= 1, and rare), which moves an output by <= ~1.2e-7 for
// |x| <= 1: atol 1e-6. Had the GPU computed angles in fp32, positions near 8192 would be off
// by ~8192 * 6e-8 = 5e-4 rad and no such bound would hold. bf16: one bf16 rounding may flip.
class GpuRope : public ::testing::TestWithParam<DType> {};

TEST_P(GpuRope, ForwardBackwardAndInPlaceMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const Tolerance tol = t == DType::F32 ? Tolerance{1e-6, 0.0} : default_tolerance(t);
  struct Case {
    Shape shape;
    int64_t offset;
  };
  // Positions up to 2047, and with an offset up to 6144 + 2047 = 8191. Half head dims 32 and 64
  // take bf16's vectorised kernel (8 pairs per thread), 10 the scalar one.
  for (const Case& c : {Case{{2, 2048, 4, 64}, 0}, Case{{1, 2048, 2, 128}, 6144}, Case{{3, 17, 5, 128}, 11},
                        Case{{2, 300, 3, 64}, 0}, Case{{2, 9, 3, 20}, 5}}) {
    Tensor x = random_tensor(c.shape, t), dy = random_tensor(c.shape, t);
    const int64_t offset = c.offset;
    expect_cuda_matches_cpu({x, dy}, {{c.shape, t}, {c.shape, t}, {c.shape, t}},
                            [offset](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::rope_forward(in[0], out[0], 10000.0, offset);
                              ops::rope_backward(in[1], out[1], 10000.0, offset);
                              out[2].copy_from(in[0]);
                              ops::rope_forward(out[2], out[2], 10000.0, offset);  // in place
                            },
                            {tol});
    if (HasFailure()) FAIL() << "shape " << shape_str(c.shape) << " offset " << offset;
  }
}

// YaRN (DeepSeek-V3's scaling, a cos/sin magnitude != 1): the same table formula on both backends.
TEST_P(GpuRope, YarnMatchesCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const Tolerance tol = t == DType::F32 ? Tolerance{1e-6, 0.0} : default_tolerance(t);
  ops::RopeScaling s;
  s.factor = 40;
  s.original_max_position = 4096;
  s.mscale = 0.9;
  s.mscale_all_dim = 1;
  for (const Shape& shape : {Shape{2, 300, 4, 64}, Shape{1, 9, 3, 20}}) {
    Tensor x = random_tensor(shape, t), dy = random_tensor(shape, t);
    expect_cuda_matches_cpu({x, dy}, {{shape, t}, {shape, t}},
                            [&s](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::rope_forward(in[0], out[0], 10000.0, s, 5000);
                              ops::rope_backward(in[1], out[1], 10000.0, s, 5000);
                            },
                            {tol});
    if (HasFailure()) FAIL() << "shape " << shape_str(shape);
  }
}

TEST_P(GpuRope, BackwardOfForwardIsIdentity) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const Shape shape{2, 1024, 4, 128};
  Tensor x = random_tensor(shape, t, kCuda), y = Tensor::empty(shape, t, kCuda);
  ops::rope_forward(x, y, 500000.0, 4096);
  ops::rope_backward(y, y, 500000.0, 4096);
  // f32: a few roundings of values <= 1; bf16: the intermediate is rounded to bf16.
  EXPECT_TRUE(allclose(y, x, t == DType::F32 ? Tolerance{1e-6, 1e-6} : Tolerance{2e-2, 2e-2}));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuRope, ::testing::Values(DType::F32, DType::BF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });
