// MoE dispatch on the CPU: capacity, routing plan, permute/unpermute (Megatron's behaviours).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "moecore/ops/elementwise.h"
#include "moecore/ops/permute.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

// Every token picks k distinct experts at random.
Tensor random_indices(int64_t T, int64_t k, int64_t E) {
  std::mt19937_64 rng(fresh_seed());
  std::vector<int32_t> v;
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

// The hand-made example: T = 4, k = 2, E = 3.
const std::vector<int32_t> kIdx = {2, 0, 1, 2, 0, 1, 2, 1};
const std::vector<float> kProbs = {0.6f, 0.4f, 0.7f, 0.3f, 0.5f, 0.5f, 0.8f, 0.2f};

int64_t count_kept(const Tensor& kept) {
  int64_t n = 0;
  for (uint8_t v : kept.to_vector<uint8_t>()) n += v;
  return n;
}

std::vector<int64_t> to_i64(const Tensor& t) {
  std::vector<int64_t> out;
  for (int32_t v : t.to_vector<int32_t>()) out.push_back(v);
  return out;
}

// Expert of each permuted row (-1 for padding rows) from the routing's layout.
std::vector<int64_t> row_experts(const ops::MoeRouting& r, const Tensor& indices) {
  std::vector<int64_t> ex(static_cast<size_t>(r.num_rows), -1);
  const auto rm = r.row_map.to_vector<int32_t>();
  const auto idx = indices.to_vector<int32_t>();
  for (size_t i = 0; i < rm.size(); ++i)
    if (rm[i] >= 0) ex[static_cast<size_t>(rm[i])] = idx[i];
  return ex;
}

}  // namespace

// ---- capacity ---------------------------------------------------------------------------
TEST(MoeCapacity, MegatronFormulaCappedAtTokens) {
  EXPECT_EQ(ops::expert_capacity(10, 2, 4, 1.0), 5);    // ceil(20 / 4 * 1)
  EXPECT_EQ(ops::expert_capacity(10, 2, 4, 1.5), 8);    // ceil(7.5)
  EXPECT_EQ(ops::expert_capacity(10, 2, 4, 0.1), 1);    // ceil(0.5)
  EXPECT_EQ(ops::expert_capacity(7, 3, 8, 1.0), 3);     // ceil(2.625)
  EXPECT_EQ(ops::expert_capacity(4, 4, 2, 2.0), 4);     // ceil(16) > T: capped, nothing drops
  EXPECT_EQ(ops::expert_capacity(0, 2, 4, 1.0), 0);
  EXPECT_THROW(ops::expert_capacity(10, 2, 0, 1.0), Error);
  EXPECT_THROW(ops::expert_capacity(10, 2, 4, 0.0), Error);
  EXPECT_THROW(ops::expert_capacity(10, 2, 4, NAN), Error);
}

TEST(MoeCapacity, ProbsPolicyKeepsHighestProbabilities) {
  Tensor idx = Tensor::from_vector(kIdx, {4, 2}), probs = Tensor::from_vector(kProbs, {4, 2});
  Tensor kept = poisoned({4, 2}, DType::U8);
  ops::capacity_mask(idx, probs, 3, 2, ops::DropPolicy::Probs, kept);
  // expert 1: (1,0) .7, (2,1) .5 kept, (3,1) .2 dropped; expert 2: (3,0) .8, (0,0) .6 kept, (1,1) .3 dropped.
  EXPECT_EQ(kept.to_vector<uint8_t>(), (std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 0}));
  // Same in f64.
  Tensor probs64 = Tensor::from_vector(std::vector<double>(kProbs.begin(), kProbs.end()), {4, 2});
  ops::capacity_mask(idx, probs64, 3, 2, ops::DropPolicy::Probs, kept);
  EXPECT_EQ(kept.to_vector<uint8_t>(), (std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 0}));
}

TEST(MoeCapacity, ProbsPolicyBreaksTiesByTokenOrder) {
  Tensor idx = Tensor::from_vector(std::vector<int32_t>{0, 0, 0, 0, 0}, {5, 1});
  Tensor probs = Tensor::from_vector(std::vector<float>{0.3f, 0.5f, 0.9f, 0.5f, 0.5f}, {5, 1});
  Tensor kept = poisoned({5, 1}, DType::U8);
  ops::capacity_mask(idx, probs, 1, 3, ops::DropPolicy::Probs, kept);
  EXPECT_EQ(kept.to_vector<uint8_t>(), (std::vector<uint8_t>{0, 1, 1, 1, 0}));
}

TEST(MoeCapacity, PositionPolicyKeepsFirstInTokenOrder) {
  Tensor idx = Tensor::from_vector(kIdx, {4, 2}), probs = Tensor::from_vector(kProbs, {4, 2});
  Tensor kept = poisoned({4, 2}, DType::U8);
  ops::capacity_mask(idx, probs, 3, 2, ops::DropPolicy::Position, kept);
  // expert 1 keeps (1,0), (2,1); expert 2 keeps (0,0), (1,1): token 3 loses both assignments.
  EXPECT_EQ(kept.to_vector<uint8_t>(), (std::vector<uint8_t>{1, 1, 1, 1, 1, 1, 0, 0}));
}

TEST(MoeCapacity, BoundsHoldWithAndWithoutPadding) {
  for (double cf : {0.5, 1.0, 1.25, 4.0}) {
    for (auto policy : {ops::DropPolicy::Probs, ops::DropPolicy::Position}) {
      const int64_t T = 97, k = 3, E = 8;
      Tensor idx = random_indices(T, k, E), probs = random_tensor({T, k}, DType::F32, Device::cpu(), 0, 1);
      const int64_t C = ops::expert_capacity(T, k, E, cf);
      Tensor kept = poisoned({T, k}, DType::U8);
      ops::capacity_mask(idx, probs, E, C, policy, kept);
      const int64_t n_kept = count_kept(kept);
      EXPECT_LE(n_kept, E * C) << "cf " << cf;
      if (C >= T) EXPECT_EQ(n_kept, T * k);  // capped capacity: nothing drops
      ops::MoeRouting plain = ops::make_moe_routing(idx, kept, E);
      EXPECT_EQ(plain.num_rows, n_kept);
      for (int64_t c : plain.host_tokens_per_expert) EXPECT_LE(c, C);
      ops::MoeRouting padded = ops::make_moe_routing(idx, kept, E, C);
      EXPECT_EQ(padded.num_rows, E * C);
      EXPECT_EQ(std::accumulate(padded.host_tokens_per_expert.begin(), padded.host_tokens_per_expert.end(),
                                int64_t{0}),
                E * C);
      EXPECT_EQ(to_i64(padded.tokens_per_expert), padded.host_tokens_per_expert);
    }
  }
}

// ---- routing plan -----------------------------------------------------------------------
TEST(MoeRouting, RowsGroupedByExpertThenTokenOrder) {
  Tensor idx = Tensor::from_vector(kIdx, {4, 2});
  ops::MoeRouting r = ops::make_moe_routing(idx, Tensor(), 3);
  // expert 0: (0,1) (2,0) -> 0 1; expert 1: (1,0) (2,1) (3,1) -> 2 3 4; expert 2: (0,0) (1,1) (3,0) -> 5 6 7.
  EXPECT_EQ(r.row_map.to_vector<int32_t>(), (std::vector<int32_t>{5, 0, 2, 6, 1, 3, 7, 4}));
  EXPECT_EQ(r.tokens_per_expert.to_vector<int32_t>(), (std::vector<int32_t>{2, 3, 3}));
  EXPECT_EQ(r.host_tokens_per_expert, (std::vector<int64_t>{2, 3, 3}));
  EXPECT_EQ(r.num_rows, 8);
  EXPECT_EQ(r.capacity, 0);
}

TEST(MoeRouting, DroppedAndPaddedLayout) {
  Tensor idx = Tensor::from_vector(kIdx, {4, 2});
  Tensor kept = Tensor::from_vector(std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 0}, {4, 2});
  ops::MoeRouting r = ops::make_moe_routing(idx, kept, 3);
  EXPECT_EQ(r.row_map.to_vector<int32_t>(), (std::vector<int32_t>{4, 0, 2, -1, 1, 3, 5, -1}));
  EXPECT_EQ(r.host_tokens_per_expert, (std::vector<int64_t>{2, 2, 2}));
  // Padded to C = 3: expert e owns rows [3e, 3e + 3); rows 2, 5 and 8 are padding.
  ops::MoeRouting p = ops::make_moe_routing(idx, kept, 3, 3);
  EXPECT_EQ(p.row_map.to_vector<int32_t>(), (std::vector<int32_t>{6, 0, 3, -1, 1, 4, 7, -1}));
  EXPECT_EQ(p.tokens_per_expert.to_vector<int32_t>(), (std::vector<int32_t>{3, 3, 3}));
  EXPECT_EQ(p.num_rows, 9);
  EXPECT_EQ(p.capacity, 3);
}

// ---- permute / unpermute ----------------------------------------------------------------
TEST(MoePermute, RoundTripRestoresInputTimesK) {
  for (DType t : {DType::F32, DType::F64, DType::BF16}) {
    for (int64_t k : {1, 3}) {
      const int64_t T = 23, E = 5, H = 17;
      Tensor idx = random_indices(T, k, E);
      ops::MoeRouting r = ops::make_moe_routing(idx, Tensor(), E);
      ASSERT_EQ(r.num_rows, T * k);
      Tensor x = random_tensor({T, H}, t);
      Tensor perm = poisoned({r.num_rows, H}, t), back = poisoned({T, H}, t);
      Tensor ones = Tensor::from_vector(std::vector<float>(static_cast<size_t>(T * k), 1.0f), {T, k});
      ops::moe_permute_forward(x, r, perm);
      ops::moe_unpermute_forward(perm, ones, r, back);
      ASSERT_TRUE(all_written(back));
      std::vector<double> want = to_doubles(x);
      for (double& v : want) v *= static_cast<double>(k);
      EXPECT_TRUE(allclose(back, Tensor::from_vector(want, {T, H}), default_tolerance(t)))
          << dtype_name(t) << " k=" << k;
    }
  }
}

TEST(MoePermute, ForwardOpsMatchFormulas) {
  const int64_t T = 31, k = 2, E = 6, H = 5;
  Tensor idx = random_indices(T, k, E);
  Tensor probs = random_tensor({T, k}, DType::F32, Device::cpu(), 0, 1);
  const int64_t C = ops::expert_capacity(T, k, E, 0.8);
  Tensor kept = Tensor::empty({T, k}, DType::U8);
  ops::capacity_mask(idx, probs, E, C, ops::DropPolicy::Probs, kept);
  for (int64_t pad : {int64_t{0}, C}) {
    ops::MoeRouting r = ops::make_moe_routing(idx, kept, E, pad);
    Tensor x = random_tensor({T, H}, DType::F32), y = random_tensor({r.num_rows, H}, DType::F32);
    Tensor perm = poisoned({r.num_rows, H}, DType::F32), out = poisoned({T, H}, DType::F32);
    ops::moe_permute_forward(x, r, perm);
    ops::moe_unpermute_forward(y, probs, r, out);
    const auto rm = r.row_map.to_vector<int32_t>();
    const auto kv = kept.to_vector<uint8_t>();
    const auto xv = to_doubles(x), yv = to_doubles(y), pv = to_doubles(probs);
    std::vector<double> want_perm(static_cast<size_t>(r.num_rows * H), 0.0), want_out(static_cast<size_t>(T * H), 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = rm[t * k + j];
        ASSERT_EQ(row >= 0, kv[t * k + j] == 1);
        if (row < 0) continue;
        for (int64_t h = 0; h < H; ++h) {
          want_perm[row * H + h] = xv[t * H + h];
          want_out[t * H + h] += pv[t * k + j] * yv[row * H + h];
        }
      }
    EXPECT_TRUE(allclose(perm, Tensor::from_vector(want_perm, {r.num_rows, H}), {0, 0})) << "pad " << pad;
    EXPECT_TRUE(allclose(out, Tensor::from_vector(want_out, {T, H}), default_tolerance(DType::F32))) << "pad " << pad;
  }
}

TEST(MoePermute, GradientsMatchFiniteDifferences) {
  const int64_t T = 7, k = 2, E = 3, H = 3;
  Tensor idx = random_indices(T, k, E);
  Tensor p0 = random_tensor({T, k}, DType::F64, Device::cpu(), 0, 1);
  const int64_t C = ops::expert_capacity(T, k, E, 0.75);
  Tensor kept = Tensor::empty({T, k}, DType::U8);
  ops::capacity_mask(idx, p0, E, C, ops::DropPolicy::Position, kept);
  GradCheckOptions opt;
  opt.max_elements = 1000;  // every element
  for (int64_t pad : {int64_t{0}, C}) {
    SCOPED_TRACE(pad ? "padded" : "unpadded");
    const ops::MoeRouting r = ops::make_moe_routing(idx, kept, E, pad);
    // permute: d x
    expect_gradients_match(
        {random_tensor({T, H}, DType::F64)},
        [&](const std::vector<Tensor>& in) {
          Tensor out = Tensor::empty({r.num_rows, H}, DType::F64);
          ops::moe_permute_forward(in[0], r, out);
          return std::vector<Tensor>{out};
        },
        [&](const std::vector<Tensor>&, const std::vector<Tensor>& dout) {
          Tensor dx = poisoned({T, H}, DType::F64);
          ops::moe_permute_backward(dout[0], r, dx);
          return std::vector<Tensor>{dx};
        },
        opt);
    // unpermute: d y (padding rows get 0) and d probs (dropped get 0)
    expect_gradients_match(
        {random_tensor({r.num_rows, H}, DType::F64), random_tensor({T, k}, DType::F64, Device::cpu(), 0, 1)},
        [&](const std::vector<Tensor>& in) {
          Tensor out = Tensor::empty({T, H}, DType::F64);
          ops::moe_unpermute_forward(in[0], in[1], r, out);
          return std::vector<Tensor>{out};
        },
        [&](const std::vector<Tensor>& in, const std::vector<Tensor>& dout) {
          Tensor dy = poisoned({r.num_rows, H}, DType::F64), dp = poisoned({T, k}, DType::F64);
          ops::moe_unpermute_backward(in[0], in[1], r, dout[0], dy, dp);
          EXPECT_TRUE(all_written(dy));
          EXPECT_TRUE(all_written(dp));
          return std::vector<Tensor>{dy, dp};
        },
        opt);
  }
}

TEST(MoePermute, DropAndPadMatchesUnpaddedRun) {
  for (DType t : {DType::F32, DType::F64}) {
    const int64_t T = 61, k = 2, E = 4, H = 9;
    Tensor idx = random_indices(T, k, E);
    Tensor probs = random_tensor({T, k}, DType::F32, Device::cpu(), 0, 1);
    const int64_t C = ops::expert_capacity(T, k, E, 1.0);
    Tensor kept = Tensor::empty({T, k}, DType::U8);
    ops::capacity_mask(idx, probs, E, C, ops::DropPolicy::Probs, kept);
    Tensor x = random_tensor({T, H}, t);
    std::vector<Tensor> outs;
    for (int64_t pad : {int64_t{0}, C}) {
      ops::MoeRouting r = ops::make_moe_routing(idx, kept, E, pad);
      Tensor perm = poisoned({r.num_rows, H}, t);
      ops::moe_permute_forward(x, r, perm);
      // A per-expert "expert computation": scale rows of expert e by (e + 1); padding rows too
      // (they are zero and must stay without effect).
      const auto ex = row_experts(r, idx);
      std::vector<double> pv = to_doubles(perm);
      for (int64_t row = 0; row < r.num_rows; ++row) {
        const double s = ex[static_cast<size_t>(row)] >= 0 ? ex[static_cast<size_t>(row)] + 1.0 : 5.0;
        for (int64_t h = 0; h < H; ++h) pv[static_cast<size_t>(row * H + h)] *= s;
      }
      Tensor y = Tensor::empty({r.num_rows, H}, t);
      ops::cast(Tensor::from_vector(pv, {r.num_rows, H}), y);
      Tensor out = poisoned({T, H}, t);
      ops::moe_unpermute_forward(y, probs, r, out);
      outs.push_back(out);
    }
    EXPECT_TRUE(allclose(outs[1], outs[0], {0, 0})) << dtype_name(t);
  }
}

TEST(MoePermute, ZeroTokenExpertsWork) {
  const int64_t T = 6, H = 4;
  // k = 1: every token to expert 2 of 4; k = 2: every token to experts 3 and 1.
  for (int64_t k : {1, 2}) {
    std::vector<int32_t> v;
    for (int64_t t = 0; t < T; ++t) {
      if (k == 1) v.push_back(2);
      else v.insert(v.end(), {3, 1});
    }
    Tensor idx = Tensor::from_vector(v, {T, k});
    ops::MoeRouting r = ops::make_moe_routing(idx, Tensor(), 4);
    EXPECT_EQ(r.host_tokens_per_expert,
              k == 1 ? (std::vector<int64_t>{0, 0, 6, 0}) : (std::vector<int64_t>{0, 6, 0, 6}));
    Tensor x = random_tensor({T, H}, DType::F32);
    Tensor perm = poisoned({r.num_rows, H}, DType::F32), back = poisoned({T, H}, DType::F32);
    Tensor half = Tensor::from_vector(std::vector<float>(static_cast<size_t>(T * k), 1.0f / k), {T, k});
    ops::moe_permute_forward(x, r, perm);
    ops::moe_unpermute_forward(perm, half, r, back);
    EXPECT_TRUE(allclose(back, x, default_tolerance(DType::F32))) << "k=" << k;
  }
  // No tokens at all (a rank that receives none).
  Tensor none = Tensor::empty({0, 2}, DType::I32);
  ops::MoeRouting r = ops::make_moe_routing(none, Tensor(), 4, 3);
  EXPECT_EQ(r.num_rows, 12);
  Tensor x = Tensor::empty({0, 5}, DType::F32), perm = poisoned({12, 5}, DType::F32);
  ops::moe_permute_forward(x, r, perm);
  EXPECT_EQ(to_doubles(perm), std::vector<double>(60, 0.0));
}

TEST(MoePermute, TokenWithAllAssignmentsDroppedGetsZero) {
  Tensor idx = Tensor::from_vector(kIdx, {4, 2}), probs = Tensor::from_vector(kProbs, {4, 2});
  Tensor kept = Tensor::empty({4, 2}, DType::U8);
  ops::capacity_mask(idx, probs, 3, 2, ops::DropPolicy::Position, kept);  // token 3 loses both
  ops::MoeRouting r = ops::make_moe_routing(idx, kept, 3);
  Tensor y = random_tensor({r.num_rows, 3}, DType::F32), out = poisoned({4, 3}, DType::F32);
  ops::moe_unpermute_forward(y, probs, r, out);
  const auto o = out.to_vector<float>();
  EXPECT_EQ(std::vector<float>(o.begin() + 9, o.end()), std::vector<float>(3, 0.0f));
  EXPECT_NE(o[0], 0.0f);
  Tensor dout = random_tensor({4, 3}, DType::F32), dy = poisoned({r.num_rows, 3}, DType::F32);
  Tensor dp = poisoned({4, 2}, DType::F32), dx = poisoned({4, 3}, DType::F32);
  ops::moe_unpermute_backward(y, probs, r, dout, dy, dp);
  EXPECT_EQ(dp.to_vector<float>()[6], 0.0f);
  EXPECT_EQ(dp.to_vector<float>()[7], 0.0f);
  ops::moe_permute_backward(y, r, dx);
  const auto d = dx.to_vector<float>();
  EXPECT_EQ(std::vector<float>(d.begin() + 9, d.end()), std::vector<float>(3, 0.0f));
}

// ---- bad arguments ----------------------------------------------------------------------
TEST(MoePermute, RejectsBadArguments) {
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 1, 7, 2}, {2, 2});
  try {
    ops::make_moe_routing(bad, Tensor(), 4);
    FAIL() << "out-of-range index accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "make_moe_routing: indices[1, 0] = 7 is out of range [0, 4)");
  }
  Tensor neg = Tensor::from_vector(std::vector<int32_t>{0, -1}, {1, 2});
  try {
    Tensor kept = Tensor::empty({1, 2}, DType::U8);
    ops::capacity_mask(neg, Tensor::zeros({1, 2}, DType::F32), 4, 1, ops::DropPolicy::Probs, kept);
    FAIL() << "negative index accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "capacity_mask: indices[0, 1] = -1 is out of range [0, 4)");
  }
  Tensor idx = Tensor::from_vector(kIdx, {4, 2});
  // Padding smaller than an expert's kept assignments.
  EXPECT_THROW(ops::make_moe_routing(idx, Tensor(), 3, 2), Error);
  // Wrong dtypes and shapes.
  EXPECT_THROW(ops::make_moe_routing(Tensor::zeros({4, 2}, DType::I64), Tensor(), 3), Error);
  EXPECT_THROW(ops::make_moe_routing(idx, Tensor::zeros({4, 2}, DType::I32), 3), Error);
  EXPECT_THROW(ops::make_moe_routing(idx, Tensor::zeros({4, 1}, DType::U8), 3), Error);
  EXPECT_THROW(ops::make_moe_routing(idx, Tensor(), 0), Error);
  ops::MoeRouting r = ops::make_moe_routing(idx, Tensor(), 3);
  Tensor x = Tensor::zeros({4, 5}, DType::F32), out = Tensor::zeros({7, 5}, DType::F32);
  try {
    ops::moe_permute_forward(x, r, out);
    FAIL() << "wrong output rows accepted";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "moe_permute_forward: argument 'out' has shape (7, 5); expected (8, 5)");
  }
  Tensor y = Tensor::zeros({8, 5}, DType::F32), o = Tensor::zeros({4, 5}, DType::F32);
  EXPECT_THROW(ops::moe_unpermute_forward(y, Tensor::zeros({4, 3}, DType::F32), r, o), Error);
  EXPECT_THROW(ops::moe_unpermute_forward(y, Tensor::zeros({4, 2}, DType::BF16), r, o), Error);
  Tensor o16 = Tensor::zeros({4, 5}, DType::BF16);
  EXPECT_THROW(ops::moe_unpermute_forward(y, Tensor::zeros({4, 2}, DType::F32), r, o16), Error);
  EXPECT_THROW(ops::moe_permute_forward(x, ops::MoeRouting{}, out), Error);
}

// The plan's device-side fields on the CPU backend: row offsets (prefix sums of the GEMM sizes),
// kept counts (the real ones when padded), no deferred status; accumulate_counts adds them up.
TEST(MoeRouting, RowOffsetsAndKeptCountsMatchTheLayout) {
  const Tensor idx = Tensor::from_vector(kIdx, {4, 2});
  for (int64_t pad : {0, 4}) {
    SCOPED_TRACE(pad);
    const ops::MoeRouting r = ops::make_moe_routing(idx, Tensor(), 3, pad, false);  // CPU: counts always on host
    ASSERT_EQ(r.host_tokens_per_expert.size(), 3u);
    EXPECT_FALSE(r.status.defined());
    // kIdx: expert 0 twice, expert 1 three times, expert 2 three times.
    EXPECT_EQ(to_i64(r.kept_per_expert), (std::vector<int64_t>{2, 3, 3}));
    const std::vector<int64_t> expected_off =
        pad > 0 ? std::vector<int64_t>{0, 4, 8, 12} : std::vector<int64_t>{0, 2, 5, 8};
    EXPECT_EQ(to_i64(r.row_offsets), expected_off);
    EXPECT_EQ(r.num_rows, expected_off.back());
    const std::vector<int64_t> ex = row_experts(r, idx);
    for (int64_t e = 0; e < 3; ++e)
      for (int64_t row = expected_off[e]; row < expected_off[e] + to_i64(r.kept_per_expert)[e]; ++row)
        EXPECT_EQ(ex[static_cast<size_t>(row)], e) << "row " << row;
    EXPECT_NO_THROW(ops::check_moe_routing(r, idx));
  }
  Tensor acc = Tensor::zeros({5}, DType::I64);
  const ops::MoeRouting r = ops::make_moe_routing(idx, Tensor(), 3);
  ops::accumulate_routing_counts(r, acc);
  ops::accumulate_routing_counts(r, acc);
  EXPECT_EQ(acc.to_vector<int64_t>(), (std::vector<int64_t>{4, 6, 6, 0, 0}));
  Tensor wrong = Tensor::zeros({5}, DType::F32);
  try {
    ops::accumulate_routing_counts(r, wrong);
    FAIL() << "an f32 accumulator accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("accumulate_routing_counts"), std::string::npos) << e.what();
  }
  Tensor short_acc = Tensor::zeros({3}, DType::I64);
  EXPECT_THROW(ops::accumulate_routing_counts(r, short_acc), Error);  // E + 2 entries expected
}

TEST(MoePermute, ProbsFollowTheirRowsDroppedAndPadded) {
  Tensor idx = Tensor::from_vector(kIdx, {4, 2});
  Tensor kept = Tensor::from_vector(std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 0}, {4, 2});
  Tensor probs = Tensor::from_vector(kProbs, {4, 2});
  for (int64_t pad : {0, 3}) {
    SCOPED_TRACE("pad " + std::to_string(pad));
    ops::MoeRouting r = ops::make_moe_routing(idx, kept, 3, pad);
    Tensor rows = poisoned({r.num_rows, 1}, DType::F32);
    ops::moe_permute_probs_forward(probs, r, rows);
    ASSERT_TRUE(all_written(rows));
    // Row row_map[t, j] holds probs[t, j]; padding rows 0 (layouts in DroppedAndPaddedLayout).
    const std::vector<float> want = pad == 0 ? std::vector<float>{0.4f, 0.5f, 0.7f, 0.5f, 0.6f, 0.8f}
                                             : std::vector<float>{0.4f, 0.5f, 0, 0.7f, 0.5f, 0, 0.6f, 0.8f, 0};
    EXPECT_EQ(rows.to_vector<float>(), want);
    // Backward: each assignment reads its row's gradient, dropped ones 0.
    std::vector<float> d(static_cast<size_t>(r.num_rows));
    for (size_t i = 0; i < d.size(); ++i) d[i] = 10.0f + static_cast<float>(i);
    Tensor dprobs = poisoned({4, 2}, DType::F32);
    ops::moe_permute_probs_backward(Tensor::from_vector(d, {r.num_rows, 1}), r, dprobs);
    const std::vector<int32_t> rm = r.row_map.to_vector<int32_t>();
    std::vector<float> want_d(8);
    for (size_t i = 0; i < 8; ++i) want_d[i] = rm[i] < 0 ? 0.0f : d[static_cast<size_t>(rm[i])];
    EXPECT_EQ(dprobs.to_vector<float>(), want_d);
  }
}

TEST(MoePermute, ProbsOpsRejectBadArguments) {
  Tensor idx = Tensor::from_vector(kIdx, {4, 2});
  ops::MoeRouting r = ops::make_moe_routing(idx, Tensor(), 3);
  Tensor probs = Tensor::from_vector(kProbs, {4, 2});
  Tensor flat = Tensor::empty({r.num_rows}, DType::F32);
  try {
    ops::moe_permute_probs_forward(probs, r, flat);
    FAIL() << "a 1-D output accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("moe_permute_probs_forward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'out'"), std::string::npos) << e.what();
  }
  Tensor rows64 = Tensor::empty({r.num_rows, 1}, DType::F64);
  EXPECT_THROW(ops::moe_permute_probs_forward(probs, r, rows64), Error);  // dtype differs from probs
  Tensor short_rows = Tensor::empty({r.num_rows - 1, 1}, DType::F32), dprobs = Tensor::empty({4, 2}, DType::F32);
  EXPECT_THROW(ops::moe_permute_probs_backward(short_rows, r, dprobs), Error);
}
