// gpu tier: MoE dispatch on CUDA against the CPU. Routing tensors must be equal exactly (the
// layout is deterministic); permute is a copy (exact); sums over j and dot products over H
// may round differently.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/permute.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {
const Device kCuda = Device::cuda(0);

Tensor random_indices(int64_t T, int64_t k, int64_t E) {
  std::mt19937_64 rng(fresh_seed());
  std::vector<int32_t> v;
  v.reserve(static_cast<size_t>(T * k));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      std::swap(perm[j], perm[j + static_cast<int64_t>(rng() % static_cast<uint64_t>(E - j))]);
      v.push_back(perm[j]);
    }
  }
  return Tensor::from_vector(v, {T, k});
}

struct Case {
  int64_t T, k, E, H;
  double cf;  // <= 0: no dropping
  bool pad;
};

const std::vector<Case> kCases = {
    {16384, 8, 128, 64, 0, false},   // the largest routing, no drops
    {16384, 8, 128, 32, 1.0, true},  // dropped and padded
    {2048, 4, 64, 1024, 1.25, false},
    {1000, 2, 8, 999, 1.0, true},    // odd H: no 16-byte vectors
    {513, 3, 16, 7, 0.5, false},
    {37, 2, 128, 16, 0, false},      // most experts get no tokens
    {300, 3, 4, 8200, 0, false},     // long rows: several 16-byte packs per thread
    {3000, 3, 5000, 8, 1.0, true},   // E above the chunked routing's limit: the per-expert scan
    {5000, 1, 3, 40, 0.9, false},    // many chunks, few experts, drops
    // One-assignment plans over single-element rows (the sort plans moving the probabilities): f32
    // takes the thread-per-row copy of permute_probs.
    {4000, 1, 16, 1, 0, false},
    {3000, 1, 5, 1, 0.8, true},
};

// kept mask (CPU) for a case, or an undefined tensor without dropping; the capacity for padding.
std::pair<Tensor, int64_t> drop(const Case& c, const Tensor& idx, const Tensor& probs) {
  if (c.cf <= 0) return {Tensor(), 0};
  const int64_t C = ops::expert_capacity(c.T, c.k, c.E, c.cf);
  Tensor kept = Tensor::empty({c.T, c.k}, DType::U8);
  ops::capacity_mask(idx, probs, c.E, C, ops::DropPolicy::Probs, kept);
  return {kept, c.pad ? C : 0};
}
}  // namespace

TEST(GpuPermute, RoutingAndCapacityMaskEqualCpuExactly) {
  MC_REQUIRE_CUDA();
  for (const Case& c : kCases) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " k=" + std::to_string(c.k) + " E=" + std::to_string(c.E));
    Tensor idx = random_indices(c.T, c.k, c.E);
    Tensor probs = random_tensor({c.T, c.k}, DType::F32, Device::cpu(), 0, 1);
    const auto [kept, pad] = drop(c, idx, probs);
    if (kept.defined()) {
      // Probabilities in steps of 1/8: many ties, which must fall to the lower token index.
      std::vector<float> pv = probs.to_vector<float>();
      for (float& v : pv) v = std::floor(v * 8.0f) / 8.0f;
      const Tensor tied = Tensor::from_vector(pv, {c.T, c.k});
      for (const Tensor& p : {probs, tied})
        for (auto policy : {ops::DropPolicy::Probs, ops::DropPolicy::Position}) {
          const int64_t C = ops::expert_capacity(c.T, c.k, c.E, c.cf);
          Tensor kc = poisoned({c.T, c.k}, DType::U8, kCuda), kh = Tensor::empty({c.T, c.k}, DType::U8);
          ops::capacity_mask(idx.to(kCuda), p.to(kCuda), c.E, C, policy, kc);
          ops::capacity_mask(idx, p, c.E, C, policy, kh);
          EXPECT_EQ(kc.to_vector<uint8_t>(), kh.to_vector<uint8_t>()) << "policy " << static_cast<int>(policy);
        }
    }
    const ops::MoeRouting rc = ops::make_moe_routing(idx.to(kCuda), kept.defined() ? kept.to(kCuda) : Tensor(), c.E, pad);
    const ops::MoeRouting rh = ops::make_moe_routing(idx, kept, c.E, pad);
    EXPECT_EQ(rc.num_rows, rh.num_rows);
    EXPECT_EQ(rc.capacity, rh.capacity);
    EXPECT_EQ(rc.host_tokens_per_expert, rh.host_tokens_per_expert);
    EXPECT_TRUE(rc.row_map.device().is_cuda() && rc.tokens_per_expert.device().is_cuda());
    EXPECT_EQ(rc.row_map.to_vector<int32_t>(), rh.row_map.to_vector<int32_t>());
    EXPECT_EQ(rc.tokens_per_expert.to_vector<int32_t>(), rh.tokens_per_expert.to_vector<int32_t>());
  }
}

class GpuPermuteOps : public ::testing::TestWithParam<DType> {};

TEST_P(GpuPermuteOps, ForwardAndBackwardMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  for (const Case& c : kCases) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " k=" + std::to_string(c.k) + " E=" + std::to_string(c.E) +
                 " H=" + std::to_string(c.H));
    Tensor idx = random_indices(c.T, c.k, c.E);
    Tensor probs = random_tensor({c.T, c.k}, DType::F32, Device::cpu(), 0, 1);
    const auto [kept, pad] = drop(c, idx, probs);
    const int64_t rows = ops::make_moe_routing(idx, kept, c.E, pad).num_rows;
    Tensor x = random_tensor({c.T, c.H}, t), y = random_tensor({rows, c.H}, t);
    Tensor dtok = random_tensor({c.T, c.H}, t), drow = random_tensor({rows, c.H}, t);
    Tensor drow_probs = random_tensor({rows, 1}, DType::F32);
    // Without dropping the routing gets an undefined mask; the input slot then holds a dummy.
    const bool has_kept = kept.defined();
    Tensor kept_in = has_kept ? kept : Tensor::zeros({1}, DType::U8);
    const int64_t T = c.T, k = c.k, E = c.E, H = c.H, padding = pad;
    // dprobs sums H products in another order: atol grows like sqrt(H).
    const Tolerance dot_tol{5e-6 * std::sqrt(static_cast<double>(H)), 1e-5};
    expect_cuda_matches_cpu(
        {idx, kept_in, probs, x, y, dtok, drow, drow_probs},
        {{{rows, H}, t}, {{T, H}, t}, {{T, H}, t}, {{rows, H}, t}, {{T, k}, DType::F32}, {{T, k}, DType::I32},
         {{E}, DType::I32}, {{rows, 1}, DType::F32}, {{T, k}, DType::F32}},
        [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
          const ops::MoeRouting r = ops::make_moe_routing(in[0], has_kept ? in[1] : Tensor(), E, padding);
          ops::moe_permute_forward(in[3], r, out[0]);
          ops::moe_permute_backward(in[6], r, out[1]);
          ops::moe_unpermute_forward(in[4], in[2], r, out[2]);
          ops::moe_unpermute_backward(in[4], in[2], r, in[5], out[3], out[4]);
          out[5].copy_from(r.row_map);
          out[6].copy_from(r.tokens_per_expert);
          ops::moe_permute_probs_forward(in[2], r, out[7]);
          ops::moe_permute_probs_backward(in[7], r, out[8]);
        },
        {Tolerance{0, 0}, default_tolerance(t), default_tolerance(t), default_tolerance(t), dot_tol, Tolerance{0, 0},
         Tolerance{0, 0}, Tolerance{0, 0}, Tolerance{0, 0}});
    if (HasFailure()) return;
  }
}

TEST(GpuPermute, BadIndexNamesValueAndEmptyRankWorks) {
  MC_REQUIRE_CUDA();
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 9, 2}, {3, 2}, kCuda);
  try {
    ops::make_moe_routing(bad, Tensor(), 4);
    FAIL() << "out-of-range index accepted on CUDA";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "make_moe_routing: indices[2, 0] = 9 is out of range [0, 4)");
  }
  try {
    Tensor kept = Tensor::empty({3, 2}, DType::U8, kCuda);
    ops::capacity_mask(bad, Tensor::zeros({3, 2}, DType::F32, kCuda), 4, 1, ops::DropPolicy::Probs, kept);
    FAIL() << "out-of-range index accepted by capacity_mask on CUDA";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "capacity_mask: indices[2, 0] = 9 is out of range [0, 4)");
  }
  // Padding overflow is reported after the count copy.
  Tensor all0 = Tensor::from_vector(std::vector<int32_t>{0, 0, 0}, {3, 1}, kCuda);
  EXPECT_THROW(ops::make_moe_routing(all0, Tensor(), 2, 2), Error);
  // A rank with no tokens: padded rows are all zero, nothing else to do.
  const ops::MoeRouting r = ops::make_moe_routing(Tensor::empty({0, 2}, DType::I32, kCuda), Tensor(), 4, 3);
  EXPECT_EQ(r.num_rows, 12);
  EXPECT_EQ(r.tokens_per_expert.to_vector<int32_t>(), (std::vector<int32_t>{3, 3, 3, 3}));
  Tensor x = Tensor::empty({0, 8}, DType::BF16, kCuda), perm = poisoned({12, 8}, DType::BF16, kCuda);
  ops::moe_permute_forward(x, r, perm);
  EXPECT_EQ(to_doubles(perm), std::vector<double>(96, 0.0));
}

class GpuGroupedGemm : public ::testing::TestWithParam<DType> {};

TEST_P(GpuGroupedGemm, MatchesCpuWithEmptyExperts) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const DType wg = t == DType::BF16 ? DType::F32 : t;
  const std::vector<int64_t> groups = {0, 130, 0, 257, 1, 0, 64, 0};
  const int64_t M = 452, N = 96, K = 160, E = 8;
  Tensor x = random_tensor({M, K}, t), w = random_tensor({E, N, K}, t), dout = random_tensor({M, N}, t);
  Tensor dw0 = random_tensor({E, N, K}, wg);
  auto tol = [&](DType out, int64_t len) {
    const double s = std::sqrt(static_cast<double>(len));
    return out == DType::BF16 ? Tolerance{1e-2 * s, 1e-2} : Tolerance{2e-6 * s, 1e-5};
  };
  expect_cuda_matches_cpu({x, w, dout, dw0}, {{{M, N}, t}, {{M, K}, t}, {{E, N, K}, wg}},
                          [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                            ops::grouped_gemm_forward(in[0], in[1], groups, out[0]);
                            ops::grouped_gemm_dgrad(in[2], in[1], groups, out[1]);
                            out[2].copy_from(in[3]);
                            ops::grouped_gemm_wgrad(in[2], in[0], groups, out[2]);
                          },
                          {tol(t, K), tol(t, N), tol(wg, 257)});
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuGroupedGemm, ::testing::Values(DType::F32, DType::BF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuPermuteOps, ::testing::Values(DType::F32, DType::BF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });
