// ops::decode_attention on the GPU (the batched kernels) against the CPU reference (RoPE, cache
// write and ops::attention_forward row by row): the outputs, lse, the rotated q and both caches,
// for rows at different positions (0, middle, last), GQA, head dims 64 and 128 (and 16, 96,
// D = 192 with Dv = 128 as MLA, 33 (odd: the per-row path) and 320 (> 256: the per-row path)),
// f32 and bf16, with and without RoPE, and caches that start off a 16-byte boundary.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "moecore/ops/decode_attention.h"
#include "moecore/ops/elementwise.h"
#include "op_harness.h"

using namespace moecore;

namespace {

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (float& x : v) x = normal(rng);
  Tensor f = Tensor::from_vector(v, shape);
  if (dtype == DType::F32) return f;
  Tensor t = Tensor::empty(shape, dtype);
  ops::cast(f, t);
  return t;
}

std::vector<float> host_f32(const Tensor& t) {
  const Tensor c = t.to(Device::cpu());
  if (c.dtype() == DType::F32) return c.to_vector<float>();
  Tensor f = Tensor::empty(c.shape(), DType::F32);
  ops::cast(c, f);
  return f.to_vector<float>();
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = host_f32(a), y = host_f32(b);
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(double(x[i]) - y[i]));
  return m;
}

// A device copy of t whose data starts one element past a 16-byte boundary (a view into a
// larger buffer): the packed 16-byte loads must not take it.
Tensor misaligned_copy(const Tensor& t, Device dev) {
  Tensor buf = Tensor::empty({t.numel() + 1}, t.dtype(), dev);
  Tensor view = buf.slice(0, 1, t.numel() + 1).view(t.shape());
  view.copy_from(t.to(dev));
  return view;
}

// Dv: the value head dim (0: D). last: the third row's position (the cache holds last + 1).
// misaligned: the device caches start 2 or 4 bytes past a 16-byte boundary.
void check_case(DType dtype, int64_t D, bool rope, int64_t Dv = 0, int32_t last = 39, bool misaligned = false) {
  if (Dv == 0) Dv = D;
  std::mt19937 rng(static_cast<unsigned>(D + 1000 * Dv + (rope ? 1 : 0)));
  const int64_t R = 3, Hq = 4, Hkv = 2, max_len = last + 1;
  Tensor q = random_tensor({R, 1, Hq, D}, dtype, rng), k = random_tensor({R, 1, Hkv, D}, dtype, rng);
  Tensor v = random_tensor({R, 1, Hkv, Dv}, dtype, rng);
  Tensor kc = random_tensor({R, max_len, Hkv, D}, dtype, rng), vc = random_tensor({R, max_len, Hkv, Dv}, dtype, rng);
  const Tensor pos = Tensor::from_vector(std::vector<int32_t>{0, 17, last}, {R});
  const Device dev = Device::cuda(0);
  Tensor gq = q.to(dev), gk = k.to(dev), gv = v.to(dev), gpos = pos.to(dev);
  Tensor gkc = misaligned ? misaligned_copy(kc, dev) : kc.to(dev), gvc = misaligned ? misaligned_copy(vc, dev) : vc.to(dev);
  Tensor out = Tensor::empty({R, 1, Hq, Dv}, dtype), lse = Tensor::empty({R, Hq, 1}, DType::F32);
  Tensor gout = Tensor::empty(out.shape(), dtype, dev), glse = Tensor::empty({R, Hq, 1}, DType::F32, dev);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  ops::decode_attention(q, k, v, kc, vc, pos, rope, 10000.0, scale, out, lse);
  ops::decode_attention(gq, gk, gv, gkc, gvc, gpos, rope, 10000.0, scale, gout, glse);
  const double tol = dtype == DType::F32 ? 1e-5 : 2e-2;  // bf16: one rounding of O(1) values
  const std::string what =
      std::string(dtype_name(dtype)) + " D" + std::to_string(D) + " Dv" + std::to_string(Dv) + (rope ? " rope" : "") +
      (misaligned ? " misaligned caches" : "");
  EXPECT_LT(max_abs_diff(gout, out), tol) << what << " out";
  EXPECT_LT(max_abs_diff(glse, lse), 1e-4) << what << " lse";
  EXPECT_LT(max_abs_diff(gq, q), tol) << what << " rotated q";
  EXPECT_LT(max_abs_diff(gkc, kc), tol) << what << " k cache";
  EXPECT_EQ(max_abs_diff(gvc, vc), 0.0) << what << " v cache";
}

}  // namespace

TEST(GpuDecodeAttention, MisalignedCachesMatchCpu) {
  MC_REQUIRE_CUDA();
  for (DType t : {DType::BF16, DType::F32}) check_case(t, 128, true, 0, 39, true);
}

TEST(GpuDecodeAttention, MatchesCpuF32) {
  MC_REQUIRE_CUDA();
  for (int64_t d : {64, 128})
    for (bool rope : {true, false}) check_case(DType::F32, d, rope);
}

TEST(GpuDecodeAttention, MatchesCpuBf16) {
  MC_REQUIRE_CUDA();
  for (int64_t d : {64, 128})
    for (bool rope : {true, false}) check_case(DType::BF16, d, rope);
}

// Long caches: the keys split into 64 chunks per (row, head), chunks of many keys (up to 204),
// the last chunk shorter. (Caches long enough for more than 64 chunks, over 262144 keys at this
// batch, are not covered here.)
TEST(GpuDecodeAttention, LongCachesMatchCpu) {
  MC_REQUIRE_CUDA();
  for (int32_t last : {700, 5000, 12999}) {
    check_case(DType::F32, 128, true, 0, last);
    check_case(DType::BF16, 128, true, 0, last);
  }
  check_case(DType::BF16, 192, true, 128, 3001);
}

// Head dims beyond 64 and 128: 16 (an imported Qwen3-MoE's), 96, MLA's 192 / 128, odd 33 and
// 320 (the per-row fallback, through ops::attention_forward on CUDA; RoPE needs an even D).
TEST(GpuDecodeAttention, AnyHeadDimMatchesCpu) {
  MC_REQUIRE_CUDA();
  for (DType t : {DType::F32, DType::BF16}) {
    for (bool rope : {true, false}) {
      check_case(t, 16, rope);
      check_case(t, 96, rope);
      check_case(t, 192, rope, 128);
      check_case(t, 320, rope, 64);
    }
    check_case(t, 33, false, 20);
  }
}
