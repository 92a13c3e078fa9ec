// gpu tier: CUDA causal GQA attention (forward and backward) against the CPU op.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "moecore/ops/attention.h"
#include "moecore/ops/attention_flash_hopper.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

const Device kCuda = Device::cuda(0);

struct AttnCase {
  DType dtype;
  int64_t S, D;
};

// Tolerances. Both devices compute in fp32 from the same stored inputs; they differ in the
// order of the sums (over D for scores, over up to S keys for outputs and dK/dV, over the 4
// query heads of a group for dK/dV) and in expf/logf (a few ulp): relative errors of about
// sqrt(n) * 6e-8 on sums of n terms. Measured (f32, S = 1024, D = 128): max
// |diff| 5e-7 for out (|out| <= 1: a convex combination of v), 2e-6 for lse (|lse| ~ 8) and
// 2.5e-6 for the gradients (|dv| up to ~6); the f32 tolerances leave about 10x.
// bf16: the stored outputs are rounded from fp32 values that differ as above, so a value
// near a rounding boundary can round to neighbouring bf16 numbers on the two devices: one
// bf16 step is 2^-8..2^-7 relative; measured max 0.8% relative, so rtol 2e-2 (the brief's
// ~2e-2) with atol 2e-3 for values that cancel to ~0. lse stays f32 for bf16 inputs.
// The GEMM path's forward also rounds P to bf16 before P V (as flash attention does): each
// weight carries a relative error up to 2^-9, so out moves by up to 2^-9 * sum_t P_t |v_t| <=
// 2^-9 max|v| ~ 2e-3 (|v| <= 1 here) on top of the output's own rounding: atol 4e-3 for out
// (seen once: 2.5e-3 on an element of -0.015, seed 95135831841, S = 64, D = 32).
std::vector<Tolerance> tolerances(DType t) {
  const Tolerance lse{1e-5, 1e-5};
  if (t == DType::BF16) return {{4e-3, 2e-2}, lse, {2e-3, 2e-2}, {2e-3, 2e-2}, {2e-3, 2e-2}};
  return {{5e-6, 1e-5}, lse, {2e-5, 1e-4}, {2e-5, 1e-4}, {2e-5, 1e-4}};
}

// Sets an environment variable for the scope of a test (MOECORE_ATTENTION picks the CUDA path).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Forward and backward on CUDA (under the current MOECORE_ATTENTION) against the CPU, from
// random inputs; the backward gets the CPU's out and lse on both devices. Sk: keys (0: S);
// softmax scale 1 / sqrt(D) unless given; Dv: the value head dim (0: D).
void check_against_cpu(DType t, int64_t B, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t Sk = 0,
                       std::optional<double> given_scale = std::nullopt, int64_t Dv = 0) {
  if (Sk == 0) Sk = S;
  if (Dv == 0) Dv = D;
  const double scale = given_scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
  Tensor q = random_tensor({B, S, Hq, D}, t, Device::cpu(), -2, 2);
  Tensor k = random_tensor({B, Sk, Hkv, D}, t, Device::cpu(), -2, 2);
  Tensor v = random_tensor({B, Sk, Hkv, Dv}, t), dout = random_tensor({B, S, Hq, Dv}, t);
  Tensor out = Tensor::empty(dout.shape(), t), lse = Tensor::empty({B, Hq, S}, DType::F32);
  ops::attention_forward(q, k, v, scale, out, lse);
  expect_cuda_matches_cpu({q, k, v, out, lse, dout},
                          {{out.shape(), t}, {lse.shape(), DType::F32}, {q.shape(), t}, {k.shape(), t}, {v.shape(), t}},
                          [&](const std::vector<Tensor>& in, std::vector<Tensor>& o) {
                            ops::attention_forward(in[0], in[1], in[2], scale, o[0], o[1]);
                            ops::attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], scale, o[2], o[3], o[4]);
                          },
                          tolerances(t));
}

}  // namespace

class GpuAttention : public ::testing::TestWithParam<AttnCase> {};

TEST_P(GpuAttention, ForwardAndBackwardMatchCpu) {
  MC_REQUIRE_CUDA();
  const AttnCase c = GetParam();
  const int64_t B = 2, Hq = 8, Hkv = 2;  // GQA 8:2
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  const DType t = c.dtype, lse_t = DType::F32;
  // q, k in [-2, 2): scores of std ~1.3 after scaling, so the softmax is far from uniform.
  Tensor q = random_tensor({B, c.S, Hq, c.D}, t, Device::cpu(), -2, 2);
  Tensor k = random_tensor({B, c.S, Hkv, c.D}, t, Device::cpu(), -2, 2);
  Tensor v = random_tensor({B, c.S, Hkv, c.D}, t), dout = random_tensor(q.shape(), t);
  // The backward gets the same out and lse on both devices (the CPU's), so that a bf16 out
  // that rounded differently does not feed into Dr.
  Tensor out = Tensor::empty(q.shape(), t), lse = Tensor::empty({B, Hq, c.S}, lse_t);
  ops::attention_forward(q, k, v, scale, out, lse);
  expect_cuda_matches_cpu({q, k, v, out, lse, dout},
                          {{q.shape(), t}, {lse.shape(), lse_t}, {q.shape(), t}, {k.shape(), t}, {k.shape(), t}},
                          [&](const std::vector<Tensor>& in, std::vector<Tensor>& o) {
                            ops::attention_forward(in[0], in[1], in[2], scale, o[0], o[1]);
                            ops::attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], scale, o[2], o[3], o[4]);
                          },
                          tolerances(t));
}

std::vector<AttnCase> attention_cases() {
  std::vector<AttnCase> v;
  for (DType t : {DType::F32, DType::BF16})
    for (auto [s, d] : std::vector<std::pair<int64_t, int64_t>>{{64, 32}, {200, 64}, {1024, 128}}) v.push_back({t, s, d});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuAttention, ::testing::ValuesIn(attention_cases()),
                         [](const ::testing::TestParamInfo<AttnCase>& i) {
                           return std::string(dtype_name(i.param.dtype)) + "_S" + std::to_string(i.param.S) + "_D" +
                                  std::to_string(i.param.D);
                         });

TEST(GpuAttentionGroups, MhaAndMqaMatchCpu) {
  MC_REQUIRE_CUDA();
  // Hkv == Hq (no sharing) and Hkv == 1 (all query heads share one kv head); S = 130 ends
  // in a partial tile.
  for (int64_t hkv : {4, 1}) {
    const int64_t B = 3, S = 130, Hq = 4, D = 64;
    const double scale = 1.0 / 8.0;
    Tensor q = random_tensor({B, S, Hq, D}, DType::F32, Device::cpu(), -2, 2);
    Tensor k = random_tensor({B, S, hkv, D}, DType::F32, Device::cpu(), -2, 2);
    Tensor v = random_tensor(k.shape(), DType::F32), dout = random_tensor(q.shape(), DType::F32);
    Tensor out = Tensor::empty(q.shape(), DType::F32), lse = Tensor::empty({B, Hq, S}, DType::F32);
    ops::attention_forward(q, k, v, scale, out, lse);
    expect_cuda_matches_cpu(
        {q, k, v, out, lse, dout},
        {{q.shape(), DType::F32}, {lse.shape(), DType::F32}, {q.shape(), DType::F32}, {k.shape(), DType::F32},
         {k.shape(), DType::F32}},
        [&](const std::vector<Tensor>& in, std::vector<Tensor>& o) {
          ops::attention_forward(in[0], in[1], in[2], scale, o[0], o[1]);
          ops::attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], scale, o[2], o[3], o[4]);
        },
        tolerances(DType::F32));
    if (HasFailure()) FAIL() << "Hkv = " << hkv;
  }
}

TEST(GpuAttentionGroups, BackwardIsDeterministic) {
  MC_REQUIRE_CUDA();
  const int64_t B = 1, S = 300, Hq = 8, Hkv = 2, D = 64;
  Tensor q = random_tensor({B, S, Hq, D}, DType::BF16, kCuda), k = random_tensor({B, S, Hkv, D}, DType::BF16, kCuda);
  Tensor v = random_tensor(k.shape(), DType::BF16, kCuda), dout = random_tensor(q.shape(), DType::BF16, kCuda);
  Tensor out = Tensor::empty(q.shape(), DType::BF16, kCuda), lse = Tensor::empty({B, Hq, S}, DType::F32, kCuda);
  ops::attention_forward(q, k, v, 0.125, out, lse);
  std::vector<std::vector<float>> runs[2];
  for (auto& r : runs) {
    Tensor g[3] = {Tensor::empty(q.shape(), DType::BF16, kCuda), Tensor::empty(k.shape(), DType::BF16, kCuda),
                   Tensor::empty(k.shape(), DType::BF16, kCuda)};
    ops::attention_backward(q, k, v, out, lse, dout, 0.125, g[0], g[1], g[2]);
    for (const Tensor& x : g) {
      const std::vector<double> d = to_doubles(x);
      r.emplace_back(d.begin(), d.end());
    }
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(runs[0][i], runs[1][i]) << "gradient " << "qkv"[i] << " changed between runs";
}

// D = 48 was refused on CUDA before the runtime-sized tiled kernels (attention_any_cuda.cu); every
// head dim now runs (the auto path: gemm for f32 at D % 8 == 0, else tiled).
TEST(GpuAttentionGroups, HeadDim48MatchesCpu) {
  MC_REQUIRE_CUDA();
  ScopedEnv env("MOECORE_ATTENTION", "auto");
  check_against_cpu(DType::F32, 1, 8, 2, 1, 48);
  check_against_cpu(DType::BF16, 1, 8, 2, 1, 48);
}


// Both CUDA paths forced through MOECORE_ATTENTION, f32 and bf16, GQA 8:2 with a partial last
// tile (S = 130: one causal block on the GEMM path) and S = 1000 (4 causal blocks of 256, the
// last partial).
struct PathCase {
  const char* path;
  DType dtype;
  int64_t S;
};

class GpuAttentionPaths : public ::testing::TestWithParam<PathCase> {};

TEST_P(GpuAttentionPaths, MatchCpu) {
  MC_REQUIRE_CUDA();
  const PathCase c = GetParam();
  ScopedEnv env("MOECORE_ATTENTION", c.path);
  const ops::AttentionDims d{2, c.S, 8, 2, 64};
  EXPECT_EQ(ops::cuda::attention_path(d, c.dtype, 0.125),
            std::string(c.path) == "gemm" ? ops::cuda::AttentionPath::Gemm : ops::cuda::AttentionPath::Tiled);
  check_against_cpu(c.dtype, 2, c.S, 8, 2, 64);
}

std::vector<PathCase> path_cases() {
  std::vector<PathCase> v;
  for (const char* p : {"tiled", "gemm"})
    for (DType t : {DType::F32, DType::BF16})
      for (int64_t s : {130, 1000}) v.push_back({p, t, s});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Paths, GpuAttentionPaths, ::testing::ValuesIn(path_cases()),
                         [](const ::testing::TestParamInfo<PathCase>& i) {
                           return std::string(i.param.path) + "_" + dtype_name(i.param.dtype) + "_S" +
                                  std::to_string(i.param.S);
                         });

TEST(GpuAttentionGemm, AutoPicksGemmWhereSupported) {
  MC_REQUIRE_CUDA();
  ScopedEnv env("MOECORE_ATTENTION", "auto");
  // Where the flash path does not apply (f32, or D = 32): gemm within its key limit, else tiled.
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 128}, DType::F32, 0.1), ops::cuda::AttentionPath::Gemm);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 32}, DType::BF16, 0.1), ops::cuda::AttentionPath::Gemm);
  EXPECT_EQ(ops::cuda::attention_path({1, ops::cuda::kAttentionGemmMaxSeq + 64, 2, 1, 64}, DType::F32, 0.1),
            ops::cuda::AttentionPath::Tiled);
  // The limit is on the keys: few queries against too many keys take the tiled path.
  EXPECT_EQ(ops::cuda::attention_path({1, 512, 2, 1, 64, ops::cuda::kAttentionGemmMaxSeq + 64}, DType::F32, 0.1),
            ops::cuda::AttentionPath::Tiled);
  EXPECT_EQ(ops::cuda::attention_path({1, 512, 2, 1, 64, ops::cuda::kAttentionGemmMaxSeq}, DType::F32, 0.1),
            ops::cuda::AttentionPath::Gemm);
}

TEST(GpuAttentionFlashPath, AutoPicksFlashWhereSupported) {
  MC_REQUIRE_CUDA();
  ScopedEnv env("MOECORE_ATTENTION", "auto");
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 128}, DType::BF16, 0.1), ops::cuda::AttentionPath::Flash);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 16, 64}, DType::BF16, 0.1), ops::cuda::AttentionPath::Flash);
  // No key limit on the flash path.
  EXPECT_EQ(ops::cuda::attention_path({1, 512, 2, 1, 64, ops::cuda::kAttentionGemmMaxSeq + 64}, DType::BF16, 0.1),
            ops::cuda::AttentionPath::Flash);
  // A softmax scale <= 0 is not the flash path's (its running maximum is of the unscaled scores).
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 128}, DType::BF16, 0.0), ops::cuda::AttentionPath::Gemm);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 128}, DType::BF16, -0.1), ops::cuda::AttentionPath::Gemm);
}

// Scales <= 0 (auto: the gemm path) and scales other than 1 / sqrt(D) (the flash path) match the CPU
// (0.3 at D = 128 makes the scores' spread about 4.5: rows close to one-hot, peaked softmax);
// forcing the flash path with a scale <= 0 is a clear error, not NaNs.
TEST(GpuAttentionFlashPath, ScalesOtherThanOneOverSqrtDMatchCpu) {
  MC_REQUIRE_CUDA();
  {
    ScopedEnv env("MOECORE_ATTENTION", "auto");
    for (double scale : {0.0, -0.15, 0.02, 0.3}) {
      SCOPED_TRACE("scale " + std::to_string(scale));
      check_against_cpu(DType::BF16, 1, 200, 4, 2, 128, 0, scale);
      check_against_cpu(DType::BF16, 1, 200, 4, 2, 64, 0, scale);
    }
  }
  ScopedEnv env("MOECORE_ATTENTION", "flash");
  Tensor q = Tensor::zeros({1, 64, 2, 128}, DType::BF16, kCuda), k = Tensor::zeros({1, 64, 1, 128}, DType::BF16, kCuda);
  Tensor out = Tensor::zeros(q.shape(), DType::BF16, kCuda), lse = Tensor::zeros({1, 2, 64}, DType::F32, kCuda);
  try {
    ops::attention_forward(q, k, k, 0.0, out, lse);
    FAIL() << "MOECORE_ATTENTION=flash with softmax scale 0 did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("softmax scale 0 (bf16 with (D, Dv) = (64, 64), (96, 96), (128, 128), "
                                         "(256, 256) or (192, 128), scale > 0)"),
              std::string::npos)
        << e.what();
  }
}

TEST(GpuAttentionGemm, LongSequenceBf16MatchesCpu) {
  MC_REQUIRE_CUDA();
  // S = 2048, D = 128: 8 causal blocks of 256; MQA-like 4:1 group.
  ScopedEnv env("MOECORE_ATTENTION", "gemm");
  check_against_cpu(DType::BF16, 1, 2048, 4, 1, 128);
}

TEST(GpuAttentionGemm, ChunkedScoreBufferMatchesCpu) {
  MC_REQUIRE_CUDA();
  // A 1 MiB score budget: S = 300 needs 300 x 320 x 4 B = 375 KiB per (b, h) and buffer, so
  // the forward runs 2 (b, h) pairs per pass and the backward 1.
  ScopedEnv env("MOECORE_ATTENTION", "gemm"), budget("MOECORE_ATTENTION_SCORE_MB", "1");
  for (DType t : {DType::F32, DType::BF16}) {
    check_against_cpu(t, 3, 300, 4, 2, 32);
    if (HasFailure()) FAIL() << dtype_name(t);
  }
}

TEST(GpuAttentionGemm, BackwardIsDeterministic) {
  MC_REQUIRE_CUDA();
  ScopedEnv env("MOECORE_ATTENTION", "gemm");
  const int64_t B = 2, S = 700, Hq = 8, Hkv = 2, D = 128;
  Tensor q = random_tensor({B, S, Hq, D}, DType::BF16, kCuda), k = random_tensor({B, S, Hkv, D}, DType::BF16, kCuda);
  Tensor v = random_tensor(k.shape(), DType::BF16, kCuda), dout = random_tensor(q.shape(), DType::BF16, kCuda);
  Tensor out = Tensor::empty(q.shape(), DType::BF16, kCuda), lse = Tensor::empty({B, Hq, S}, DType::F32, kCuda);
  ops::attention_forward(q, k, v, 0.09, out, lse);
  std::vector<std::vector<double>> runs[2];
  for (auto& r : runs) {
    Tensor g[3] = {Tensor::empty(q.shape(), DType::BF16, kCuda), Tensor::empty(k.shape(), DType::BF16, kCuda),
                   Tensor::empty(k.shape(), DType::BF16, kCuda)};
    ops::attention_backward(q, k, v, out, lse, dout, 0.09, g[0], g[1], g[2]);
    for (const Tensor& x : g) r.push_back(to_doubles(x));
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(runs[0][i], runs[1][i]) << "gradient " << "qkv"[i] << " changed between runs";
}

TEST(GpuAttentionGemm, UnknownPathIsAClearError) {
  MC_REQUIRE_CUDA();
  ScopedEnv env("MOECORE_ATTENTION", "fast");
  Tensor q = Tensor::zeros({1, 8, 2, 32}, DType::F32, kCuda), k = Tensor::zeros({1, 8, 1, 32}, DType::F32, kCuda);
  Tensor out = Tensor::zeros(q.shape(), DType::F32, kCuda), lse = Tensor::zeros({1, 2, 8}, DType::F32, kCuda);
  try {
    ops::attention_forward(q, k, k, 0.1, out, lse);
    FAIL() << "MOECORE_ATTENTION=fast did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MOECORE_ATTENTION must be auto, tiled, gemm or flash; got 'fast'"),
              std::string::npos)
        << e.what();
  }
}

// Keys longer than queries (Sk > Sq, context parallelism: query s sees keys t <= s + Sk - Sq)
// on both CUDA paths, f32 and bf16, GQA 8:2. Sq = 130 and 1000 end in partial 64-tiles (1000:
// 4 causal query blocks of 256 on the GEMM path); offsets Sk - Sq = 170, 234, 72 are not
// multiples of 64 (so the shifted diagonal crosses tiles); Sq = 5 is one partial tile against
// 77 keys; D = 64 and 128.
struct KvCase {
  const char* path;
  DType dtype;
  int64_t B, Sq, Sk, D;
};

class GpuAttentionKvLonger : public ::testing::TestWithParam<KvCase> {};

TEST_P(GpuAttentionKvLonger, MatchCpu) {
  MC_REQUIRE_CUDA();
  const KvCase c = GetParam();
  ScopedEnv env("MOECORE_ATTENTION", c.path);
  const ops::AttentionDims d{c.B, c.Sq, 8, 2, c.D, c.Sk};
  EXPECT_EQ(ops::cuda::attention_path(d, c.dtype, 0.125),
            std::string(c.path) == "gemm" ? ops::cuda::AttentionPath::Gemm : ops::cuda::AttentionPath::Tiled);
  check_against_cpu(c.dtype, c.B, c.Sq, 8, 2, c.D, c.Sk);
}

std::vector<KvCase> kv_cases() {
  std::vector<KvCase> v;
  for (const char* p : {"tiled", "gemm"})
    for (DType t : {DType::F32, DType::BF16}) {
      v.push_back({p, t, 2, 130, 300, 64});
      v.push_back({p, t, 1, 1000, 1234, 128});
      v.push_back({p, t, 2, 5, 77, 64});
      v.push_back({p, t, 1, 200, 272, 128});
    }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Paths, GpuAttentionKvLonger, ::testing::ValuesIn(kv_cases()),
                         [](const ::testing::TestParamInfo<KvCase>& i) {
                           return std::string(i.param.path) + "_" + dtype_name(i.param.dtype) + "_Sq" +
                                  std::to_string(i.param.Sq) + "_Sk" + std::to_string(i.param.Sk) + "_D" +
                                  std::to_string(i.param.D);
                         });

TEST(GpuAttentionKvLongerGemm, ChunkedScoreBufferMatchesCpu) {
  MC_REQUIRE_CUDA();
  // A 1 MiB score budget with [Sq, Sk] score rows: Sq = 300, Sk = 450 needs 300 x 512 x 4 B =
  // 600 KiB per (b, h) and buffer, so both passes run one (b, h) pair at a time.
  ScopedEnv env("MOECORE_ATTENTION", "gemm"), budget("MOECORE_ATTENTION_SCORE_MB", "1");
  for (DType t : {DType::F32, DType::BF16}) {
    check_against_cpu(t, 2, 300, 4, 2, 32, 450);
    if (HasFailure()) FAIL() << dtype_name(t);
  }
}

TEST(GpuAttentionKvLongerGemm, BackwardIsDeterministic) {
  MC_REQUIRE_CUDA();
  for (const char* path : {"gemm", "tiled"}) {
    ScopedEnv env("MOECORE_ATTENTION", path);
    const int64_t B = 2, Sq = 333, Sk = 700, Hq = 8, Hkv = 2, D = 64;
    Tensor q = random_tensor({B, Sq, Hq, D}, DType::BF16, kCuda);
    Tensor k = random_tensor({B, Sk, Hkv, D}, DType::BF16, kCuda);
    Tensor v = random_tensor(k.shape(), DType::BF16, kCuda), dout = random_tensor(q.shape(), DType::BF16, kCuda);
    Tensor out = Tensor::empty(q.shape(), DType::BF16, kCuda), lse = Tensor::empty({B, Hq, Sq}, DType::F32, kCuda);
    ops::attention_forward(q, k, v, 0.125, out, lse);
    std::vector<std::vector<double>> runs[2];
    for (auto& r : runs) {
      Tensor g[3] = {Tensor::empty(q.shape(), DType::BF16, kCuda), Tensor::empty(k.shape(), DType::BF16, kCuda),
                     Tensor::empty(k.shape(), DType::BF16, kCuda)};
      ops::attention_backward(q, k, v, out, lse, dout, 0.125, g[0], g[1], g[2]);
      for (const Tensor& x : g) r.push_back(to_doubles(x));
    }
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(runs[0][i], runs[1][i]) << path << ": gradient " << "qkv"[i] << " changed between runs";
  }
}

TEST(GpuAttentionKvLongerGemm, KeysShorterThanQueriesIsAClearError) {
  MC_REQUIRE_CUDA();
  Tensor q = Tensor::zeros({1, 8, 2, 32}, DType::F32, kCuda), k = Tensor::zeros({1, 7, 1, 32}, DType::F32, kCuda);
  Tensor out = Tensor::zeros(q.shape(), DType::F32, kCuda), lse = Tensor::zeros({1, 2, 8}, DType::F32, kCuda);
  try {
    ops::attention_forward(q, k, k, 0.1, out, lse);
    FAIL() << "Sk = 7 < Sq = 8 on CUDA did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("key/value sequence length Sk = 7 must be >= query sequence length Sq = 8"),
              std::string::npos)
        << e.what();
  }
}

// The flash path (fused tensor-core kernels, bf16, D in {64, 128}) forced through
// MOECORE_ATTENTION=flash against the CPU, forward and backward, with the bf16 tolerances of
// the other paths. Shapes: S = 2048 (32 key tiles, 16 query tiles of 128 in the forward);
// odd sizes that end in partial tiles (77; 130 queries against 300 keys: offset 170 is not a
// multiple of any tile); GQA 8:2 and MHA; Sq = 5 against 77 keys; D = 64 and 128.
struct FlashCase {
  int64_t B, Sq, Sk, Hq, Hkv, D;
};

class GpuAttentionFlash : public ::testing::TestWithParam<FlashCase> {};

// These run the mma.sync kernels (MOECORE_ATTENTION_FLASH_HOPPER=0); GpuAttentionFlashHopper below
// runs the same comparisons through the Hopper kernels.
TEST_P(GpuAttentionFlash, MatchesCpu) {
  MC_REQUIRE_CUDA();
  const FlashCase c = GetParam();
  ScopedEnv env("MOECORE_ATTENTION", "flash"), mma("MOECORE_ATTENTION_FLASH_HOPPER", "0");
  EXPECT_EQ(ops::cuda::attention_path({c.B, c.Sq, c.Hq, c.Hkv, c.D, c.Sk}, DType::BF16, 0.1),
            ops::cuda::AttentionPath::Flash);
  check_against_cpu(DType::BF16, c.B, c.Sq, c.Hq, c.Hkv, c.D, c.Sk);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuAttentionFlash,
                         ::testing::Values(FlashCase{1, 2048, 2048, 2, 2, 128}, FlashCase{2, 77, 77, 8, 2, 64},
                                           FlashCase{2, 77, 77, 8, 2, 128}, FlashCase{2, 130, 300, 8, 2, 64},
                                           FlashCase{2, 130, 300, 8, 2, 128}, FlashCase{1, 1000, 1234, 8, 2, 128},
                                           FlashCase{2, 5, 77, 8, 2, 64}, FlashCase{2, 200, 200, 4, 4, 128},
                                           FlashCase{1, 1024, 1024, 8, 2, 64}),
                         [](const ::testing::TestParamInfo<FlashCase>& i) {
                           const FlashCase& c = i.param;
                           return "B" + std::to_string(c.B) + "_Sq" + std::to_string(c.Sq) + "_Sk" +
                                  std::to_string(c.Sk) + "_H" + std::to_string(c.Hq) + "_" + std::to_string(c.Hkv) +
                                  "_D" + std::to_string(c.D);
                         });

// True when the Hopper flash kernels take these sizes on this GPU (they decline silently
// elsewhere, so each Hopper test first checks that they are the ones that run).
bool hopper_flash_runs(const FlashCase& c) {
  Tensor q = Tensor::empty({c.B, c.Sq, c.Hq, c.D}, DType::BF16, kCuda);
  Tensor k = Tensor::empty({c.B, c.Sk, c.Hkv, c.D}, DType::BF16, kCuda);
  return ops::cuda::flash_hopper::available({c.B, c.Sq, c.Hq, c.Hkv, c.D, c.Sk}, q, k, k, &q);
}

bool is_hopper_gpu() {
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0;
}

// The Hopper kernels (wgmma, D = 128) against the CPU with the same tolerances. Shapes: many
// tiles (S = 2048: 16 query tiles, 16 / 32 key tiles); partial tiles (77, 200, 257); offsets
// that are not multiples of the tiles (130 x 300, 1000 x 1234), one that is (512 x 640) and one of
// 64 (1024 x 1088: half a forward tile); GQA 8:2, 6:3, 16:2 (groups of 8), MQA 4:1 and MHA; 5
// queries against 77 keys; grids of more CTAs than an H100 has SMs (1024 x 1088 with 16 heads:
// 256 forward and dQ CTAs; B4 H8:8 S1024: 256 dK/dV CTAs). Peaked scores: GpuAttentionFlashPath.
// ScalesOtherThanOneOverSqrtDMatchCpu.
class GpuAttentionFlashHopper : public ::testing::TestWithParam<FlashCase> {};

TEST_P(GpuAttentionFlashHopper, MatchesCpu) {
  MC_REQUIRE_CUDA();
  if (!is_hopper_gpu()) GTEST_SKIP() << "the Hopper flash kernels need a compute-capability 9.0 GPU";
  const FlashCase c = GetParam();
  ScopedEnv env("MOECORE_ATTENTION", "flash");
  ASSERT_TRUE(hopper_flash_runs(c)) << "the Hopper flash kernels declined these sizes";
  check_against_cpu(DType::BF16, c.B, c.Sq, c.Hq, c.Hkv, c.D, c.Sk);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuAttentionFlashHopper,
                         ::testing::Values(FlashCase{1, 2048, 2048, 2, 2, 128}, FlashCase{2, 77, 77, 8, 2, 128},
                                           FlashCase{2, 130, 300, 8, 2, 128}, FlashCase{1, 1000, 1234, 8, 2, 128},
                                           FlashCase{2, 5, 77, 8, 2, 128}, FlashCase{2, 200, 200, 4, 4, 128},
                                           FlashCase{1, 257, 257, 6, 3, 128}, FlashCase{1, 512, 640, 4, 1, 128},
                                           FlashCase{2, 1024, 1088, 16, 2, 128}, FlashCase{4, 1024, 1024, 8, 8, 128}),
                         [](const ::testing::TestParamInfo<FlashCase>& i) {
                           const FlashCase& c = i.param;
                           return "B" + std::to_string(c.B) + "_Sq" + std::to_string(c.Sq) + "_Sk" +
                                  std::to_string(c.Sk) + "_H" + std::to_string(c.Hq) + "_" + std::to_string(c.Hkv);
                         });

// MOECORE_ATTENTION_FLASH_SPLIT=0 on the Hopper kernels: P and dS rounded once, so dV can miss by
// a few bf16 steps where P is large and the sum cancels (attention_flash_cuda.cu); 4x the bf16
// gradient tolerances still catches a wrong product (errors of order 1). D = 128 and MLA's
// D = 192 / Dv = 128 (300 queries: 9 full 32-query tiles of its dK/dV kernel and a partial one).
TEST(GpuAttentionFlashHopperPath, SingleRoundingBackwardIsClose) {
  MC_REQUIRE_CUDA();
  if (!is_hopper_gpu()) GTEST_SKIP() << "the Hopper flash kernels need a compute-capability 9.0 GPU";
  ScopedEnv env("MOECORE_ATTENTION", "flash"), split("MOECORE_ATTENTION_FLASH_SPLIT", "0");
  for (const int64_t D : {128, 192}) {
    SCOPED_TRACE("D = " + std::to_string(D));
    const FlashCase c{2, 300, 300, 4, 2, D};
    const int64_t Dv = 128;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    Tensor q = random_tensor({c.B, c.Sq, c.Hq, D}, DType::BF16, Device::cpu(), -2, 2);
    Tensor k = random_tensor({c.B, c.Sk, c.Hkv, D}, DType::BF16, Device::cpu(), -2, 2);
    Tensor v = random_tensor({c.B, c.Sk, c.Hkv, Dv}, DType::BF16), dout = random_tensor({c.B, c.Sq, c.Hq, Dv}, DType::BF16);
    {
      Tensor qd = Tensor::empty(q.shape(), DType::BF16, kCuda), kd = Tensor::empty(k.shape(), DType::BF16, kCuda);
      Tensor vd = Tensor::empty(v.shape(), DType::BF16, kCuda), od = Tensor::empty(dout.shape(), DType::BF16, kCuda);
      ASSERT_TRUE(ops::cuda::flash_hopper::available({c.B, c.Sq, c.Hq, c.Hkv, D, c.Sk, Dv}, qd, kd, vd, &od));
    }
    Tensor out = Tensor::empty(dout.shape(), DType::BF16), lse = Tensor::empty({c.B, c.Hq, c.Sq}, DType::F32);
    ops::attention_forward(q, k, v, scale, out, lse);
    std::vector<Tolerance> tol = tolerances(DType::BF16);
    for (size_t i = 2; i < tol.size(); ++i) tol[i] = {4 * tol[i].atol, 4 * tol[i].rtol};
    expect_cuda_matches_cpu({q, k, v, out, lse, dout},
                            {{q.shape(), DType::BF16}, {k.shape(), DType::BF16}, {v.shape(), DType::BF16}},
                            [&](const std::vector<Tensor>& in, std::vector<Tensor>& o) {
                              ops::attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], scale, o[0], o[1],
                                                      o[2]);
                            },
                            {tol[2], tol[3], tol[4]});
  }
}

// MOECORE_ATTENTION_FLASH_HOPPER=0 turns the Hopper kernels off; D = 64 and f32 never take them.
TEST(GpuAttentionFlashHopperPath, SwitchAndUnsupportedSizes) {
  MC_REQUIRE_CUDA();
  if (!is_hopper_gpu()) GTEST_SKIP() << "the Hopper flash kernels need a compute-capability 9.0 GPU";
  EXPECT_TRUE(hopper_flash_runs({1, 64, 64, 2, 1, 128}));
  EXPECT_FALSE(hopper_flash_runs({1, 64, 64, 2, 1, 64}));
  {
    ScopedEnv off("MOECORE_ATTENTION_FLASH_HOPPER", "0");
    EXPECT_FALSE(hopper_flash_runs({1, 64, 64, 2, 1, 128}));
  }
  Tensor q = Tensor::empty({1, 64, 2, 128}, DType::F32, kCuda), k = Tensor::empty({1, 64, 1, 128}, DType::F32, kCuda);
  EXPECT_FALSE(ops::cuda::flash_hopper::available({1, 64, 2, 1, 128, 64}, q, k, k));
  // MLA's D = 192 / Dv = 128: the Hopper forward (no dout) and backward; other pairs (Dv != 128,
  // or D = 192 with Dv = 192) never take the Hopper kernels.
  Tensor qb = Tensor::empty({1, 64, 2, 192}, DType::BF16, kCuda), kb = Tensor::empty({1, 64, 1, 192}, DType::BF16, kCuda);
  Tensor vb = Tensor::empty({1, 64, 1, 128}, DType::BF16, kCuda), ob = Tensor::empty({1, 64, 2, 128}, DType::BF16, kCuda);
  EXPECT_TRUE(ops::cuda::flash_hopper::available({1, 64, 2, 1, 192, 64, 128}, qb, kb, vb));
  EXPECT_TRUE(ops::cuda::flash_hopper::available({1, 64, 2, 1, 192, 64, 128}, qb, kb, vb, &ob));
  {
    ScopedEnv off("MOECORE_ATTENTION_FLASH_HOPPER", "0");
    EXPECT_FALSE(ops::cuda::flash_hopper::available({1, 64, 2, 1, 192, 64, 128}, qb, kb, vb, &ob));
  }
  EXPECT_FALSE(ops::cuda::flash_hopper::available({1, 64, 2, 1, 192, 64, 192}, qb, kb, kb));
  EXPECT_FALSE(ops::cuda::flash_hopper::available({1, 64, 2, 1, 256, 64, 256}, qb, kb, kb));
}

// The Hopper kernels at MLA's D = 192 / Dv = 128 against the CPU, forward and backward (dK/dV in
// 32-query tiles, dQ in 64-key tiles of 192-wide K): many tiles, partial tiles (77, 257, 33, 31
// rows: one past a 32-query tile and one short of it), offsets that are not multiples of the
// tiles (130 x 300, 1000 x 1234, 31 x 95, 100 x 1100: every query sees at least 1000 keys, nearly
// no causal mask), one that is (512 x 640), GQA 8:2, 6:3, MQA 4:1 and MHA, 5 queries against 77
// keys, and more dK/dV CTAs than an H100 has SMs (B4 H8:8 S1024: 256).
class GpuAttentionFlashHopperMla : public ::testing::TestWithParam<FlashCase> {};

TEST_P(GpuAttentionFlashHopperMla, MatchesCpu) {
  MC_REQUIRE_CUDA();
  if (!is_hopper_gpu()) GTEST_SKIP() << "the Hopper flash kernels need a compute-capability 9.0 GPU";
  const FlashCase c = GetParam();
  ScopedEnv env("MOECORE_ATTENTION", "flash");
  Tensor q = Tensor::empty({c.B, c.Sq, c.Hq, 192}, DType::BF16, kCuda);
  Tensor o = Tensor::empty({c.B, c.Sq, c.Hq, 128}, DType::BF16, kCuda);
  Tensor k = Tensor::empty({c.B, c.Sk, c.Hkv, 192}, DType::BF16, kCuda), v = Tensor::empty({c.B, c.Sk, c.Hkv, 128}, DType::BF16, kCuda);
  ASSERT_TRUE(ops::cuda::flash_hopper::available({c.B, c.Sq, c.Hq, c.Hkv, 192, c.Sk, 128}, q, k, v, &o))
      << "the Hopper kernels declined these sizes";
  check_against_cpu(DType::BF16, c.B, c.Sq, c.Hq, c.Hkv, 192, c.Sk, std::nullopt, 128);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuAttentionFlashHopperMla,
                         ::testing::Values(FlashCase{1, 2048, 2048, 2, 2, 192}, FlashCase{2, 77, 77, 8, 2, 192},
                                           FlashCase{2, 130, 300, 8, 2, 192}, FlashCase{1, 1000, 1234, 8, 2, 192},
                                           FlashCase{2, 5, 77, 8, 2, 192}, FlashCase{2, 200, 200, 4, 4, 192},
                                           FlashCase{1, 512, 640, 4, 1, 192}, FlashCase{2, 1024, 1088, 16, 2, 192},
                                           FlashCase{1, 257, 257, 6, 3, 192}, FlashCase{2, 33, 33, 4, 2, 192},
                                           FlashCase{2, 31, 95, 4, 2, 192}, FlashCase{1, 100, 1100, 4, 4, 192},
                                           FlashCase{4, 1024, 1024, 8, 8, 192}),
                         [](const ::testing::TestParamInfo<FlashCase>& i) {
                           const FlashCase& c = i.param;
                           return "B" + std::to_string(c.B) + "_Sq" + std::to_string(c.Sq) + "_Sk" +
                                  std::to_string(c.Sk) + "_H" + std::to_string(c.Hq) + "_" + std::to_string(c.Hkv);
                         });

TEST(GpuAttentionFlashPath, BackwardIsDeterministic) {
  MC_REQUIRE_CUDA();
  ScopedEnv env("MOECORE_ATTENTION", "flash");
  for (auto [D, Dv] : std::vector<std::pair<int64_t, int64_t>>{{64, 64}, {128, 128}, {192, 128}, {256, 256}}) {
    const int64_t B = 2, Sq = 333, Sk = 700, Hq = 8, Hkv = 2;
    Tensor q = random_tensor({B, Sq, Hq, D}, DType::BF16, kCuda);
    Tensor k = random_tensor({B, Sk, Hkv, D}, DType::BF16, kCuda);
    Tensor v = random_tensor({B, Sk, Hkv, Dv}, DType::BF16, kCuda);
    Tensor dout = random_tensor({B, Sq, Hq, Dv}, DType::BF16, kCuda);
    Tensor out = Tensor::empty(dout.shape(), DType::BF16, kCuda), lse = Tensor::empty({B, Hq, Sq}, DType::F32, kCuda);
    ops::attention_forward(q, k, v, 0.1, out, lse);
    std::vector<std::vector<double>> runs[2];
    for (auto& r : runs) {
      Tensor g[3] = {Tensor::empty(q.shape(), DType::BF16, kCuda), Tensor::empty(k.shape(), DType::BF16, kCuda),
                     Tensor::empty(v.shape(), DType::BF16, kCuda)};
      ops::attention_backward(q, k, v, out, lse, dout, 0.1, g[0], g[1], g[2]);
      for (const Tensor& x : g) r.push_back(to_doubles(x));
    }
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(runs[0][i], runs[1][i]) << "D = " << D << ": gradient " << "qkv"[i] << " changed between runs";
  }
}

TEST(GpuAttentionFlashPath, UnsupportedDtypeOrHeadDimIsAClearError) {
  MC_REQUIRE_CUDA();
  ScopedEnv env("MOECORE_ATTENTION", "flash");
  Tensor q = Tensor::zeros({1, 8, 2, 64}, DType::F32, kCuda), k = Tensor::zeros({1, 8, 1, 64}, DType::F32, kCuda);
  Tensor out = Tensor::zeros(q.shape(), DType::F32, kCuda), lse = Tensor::zeros({1, 2, 8}, DType::F32, kCuda);
  try {
    ops::attention_forward(q, k, k, 0.1, out, lse);
    FAIL() << "MOECORE_ATTENTION=flash with f32 did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MOECORE_ATTENTION=flash but the flash path does not support dtype f32, "
                                         "(D, Dv) = (64, 64), softmax scale 0.1 (bf16 with (D, Dv) = (64, 64), "
                                         "(96, 96), (128, 128), (256, 256) or (192, 128), scale > 0)"),
              std::string::npos)
        << e.what();
  }
  // D = 32, 48, 192 with Dv = 192, 128 with Dv = 64 are on the other paths only.
  EXPECT_THROW(ops::cuda::attention_path({1, 8, 2, 1, 32}, DType::BF16, 0.1), Error);
  EXPECT_THROW(ops::cuda::attention_path({1, 8, 2, 1, 48}, DType::BF16, 0.1), Error);
  EXPECT_THROW(ops::cuda::attention_path({1, 8, 2, 1, 192}, DType::BF16, 0.1), Error);
  EXPECT_THROW(ops::cuda::attention_path({1, 8, 2, 1, 128, 8, 64}, DType::BF16, 0.1), Error);
  EXPECT_EQ(ops::cuda::attention_path({1, 8, 2, 1, 128}, DType::BF16, 0.1), ops::cuda::AttentionPath::Flash);
}

// Any head dims (D, Dv) on every path that takes them, forward and backward against the CPU:
// tiled (attention_any_cuda.cu's runtime-sized kernels; also the templated ones at D = Dv = 64),
// gemm (Dv = D, D % 8 == 0) and flash (mma.sync: MOECORE_ATTENTION_FLASH_HOPPER=0), with GQA 8:2,
// MQA 4:1 and MHA, keys longer than queries (offsets 170 and 72: not multiples of any tile), odd
// lengths (77, 5 against 77) and head dims: 1, 16, 33 with Dv 20, 48, 96, 160 with Dv 300 (three
// 128-column output chunks of different fill), 192 / 128 (MLA), 256.
struct AnyDimCase {
  const char* path;
  DType dtype;
  int64_t B, Sq, Sk, Hq, Hkv, D, Dv;
};

class GpuAttentionAnyHeadDim : public ::testing::TestWithParam<AnyDimCase> {};

TEST_P(GpuAttentionAnyHeadDim, MatchesCpu) {
  MC_REQUIRE_CUDA();
  const AnyDimCase c = GetParam();
  ScopedEnv env("MOECORE_ATTENTION", c.path), mma("MOECORE_ATTENTION_FLASH_HOPPER", "0");
  const std::string p = c.path;
  const auto expected = p == "gemm"    ? ops::cuda::AttentionPath::Gemm
                        : p == "flash" ? ops::cuda::AttentionPath::Flash
                                       : ops::cuda::AttentionPath::Tiled;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  EXPECT_EQ(ops::cuda::attention_path({c.B, c.Sq, c.Hq, c.Hkv, c.D, c.Sk, c.Dv}, c.dtype, scale), expected);
  check_against_cpu(c.dtype, c.B, c.Sq, c.Hq, c.Hkv, c.D, c.Sk, std::nullopt, c.Dv);
}

std::vector<AnyDimCase> any_dim_cases() {
  std::vector<AnyDimCase> v;
  using Dims = std::pair<int64_t, int64_t>;
  for (DType t : {DType::F32, DType::BF16}) {
    for (auto [D, Dv] : std::vector<Dims>{{1, 1}, {16, 16}, {33, 20}, {48, 48}, {64, 64}, {96, 96}, {160, 300},
                                          {192, 128}, {256, 256}}) {
      v.push_back({"tiled", t, 2, 77, 77, 8, 2, D, Dv});
      v.push_back({"tiled", t, 2, 130, 300, 8, 2, D, Dv});
    }
    v.push_back({"tiled", t, 2, 5, 77, 4, 1, 192, 128});
    for (int64_t D : {16, 96, 256}) {
      v.push_back({"gemm", t, 2, 77, 77, 8, 2, D, D});
      v.push_back({"gemm", t, 2, 130, 300, 8, 2, D, D});
    }
  }
  for (auto [D, Dv] : std::vector<Dims>{{64, 64}, {96, 96}, {128, 128}, {192, 128}, {256, 256}}) {
    v.push_back({"flash", DType::BF16, 2, 77, 77, 8, 2, D, Dv});
    v.push_back({"flash", DType::BF16, 2, 130, 300, 8, 2, D, Dv});
    v.push_back({"flash", DType::BF16, 2, 5, 77, 4, 1, D, Dv});
    v.push_back({"flash", DType::BF16, 1, 1000, 1234, 4, 4, D, Dv});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Dims, GpuAttentionAnyHeadDim, ::testing::ValuesIn(any_dim_cases()),
                         [](const ::testing::TestParamInfo<AnyDimCase>& i) {
                           const AnyDimCase& c = i.param;
                           return std::string(c.path) + "_" + dtype_name(c.dtype) + "_B" + std::to_string(c.B) +
                                  "_Sq" + std::to_string(c.Sq) + "_Sk" + std::to_string(c.Sk) + "_H" +
                                  std::to_string(c.Hq) + "_" + std::to_string(c.Hkv) + "_D" + std::to_string(c.D) +
                                  "_Dv" + std::to_string(c.Dv);
                         });

// The automatic choice for the new head dims: flash for bf16 at (96, 96), (192, 128), (256, 256);
// gemm for f32 at D % 8 == 0 with Dv = D; tiled for everything else (odd D, Dv != D outside
// the flash list, f32 with Dv != D). The tiled backward at (192, 128) is deterministic.
TEST(GpuAttentionAnyHeadDimPath, AutoPicksFastestSupportedPath) {
  MC_REQUIRE_CUDA();
  ScopedEnv env("MOECORE_ATTENTION", "auto");
  using ops::cuda::AttentionPath;
  EXPECT_EQ(ops::cuda::attention_path({4, 4096, 16, 16, 192, 4096, 128}, DType::BF16, 0.07), AttentionPath::Flash);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 96, 2048, 96}, DType::BF16, 0.1), AttentionPath::Flash);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 256, 2048, 256}, DType::BF16, 0.06), AttentionPath::Flash);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 96, 2048, 96}, DType::F32, 0.1), AttentionPath::Gemm);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 16, 2048, 16}, DType::BF16, 0.25), AttentionPath::Gemm);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 192, 2048, 128}, DType::F32, 0.07), AttentionPath::Tiled);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 33, 2048, 33}, DType::BF16, 0.1), AttentionPath::Tiled);
  EXPECT_EQ(ops::cuda::attention_path({4, 2048, 16, 4, 128, 2048, 64}, DType::BF16, 0.1), AttentionPath::Tiled);
  // Forcing gemm where Dv != D is a clear error naming both head dims.
  ScopedEnv gemm("MOECORE_ATTENTION", "gemm");
  try {
    ops::cuda::attention_path({1, 8, 2, 1, 192, 8, 128}, DType::F32, 0.1);
    FAIL() << "MOECORE_ATTENTION=gemm with Dv != D did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("D = 192, Dv = 128, dtype f32 (Sk <= 16384, D a multiple of 8, Dv = D"),
              std::string::npos)
        << e.what();
  }
}

TEST(GpuAttentionAnyHeadDimPath, TiledBackwardIsDeterministic) {
  MC_REQUIRE_CUDA();
  ScopedEnv env("MOECORE_ATTENTION", "tiled");
  const int64_t B = 2, Sq = 133, Sk = 300, Hq = 8, Hkv = 2, D = 192, Dv = 128;
  Tensor q = random_tensor({B, Sq, Hq, D}, DType::BF16, kCuda), k = random_tensor({B, Sk, Hkv, D}, DType::BF16, kCuda);
  Tensor v = random_tensor({B, Sk, Hkv, Dv}, DType::BF16, kCuda), dout = random_tensor({B, Sq, Hq, Dv}, DType::BF16, kCuda);
  Tensor out = Tensor::empty(dout.shape(), DType::BF16, kCuda), lse = Tensor::empty({B, Hq, Sq}, DType::F32, kCuda);
  ops::attention_forward(q, k, v, 0.07, out, lse);
  std::vector<std::vector<double>> runs[2];
  for (auto& r : runs) {
    Tensor g[3] = {Tensor::empty(q.shape(), DType::BF16, kCuda), Tensor::empty(k.shape(), DType::BF16, kCuda),
                   Tensor::empty(v.shape(), DType::BF16, kCuda)};
    ops::attention_backward(q, k, v, out, lse, dout, 0.07, g[0], g[1], g[2]);
    for (const Tensor& x : g) r.push_back(to_doubles(x));
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(runs[0][i], runs[1][i]) << "gradient " << "qkv"[i] << " changed between runs";
}
