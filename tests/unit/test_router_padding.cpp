// --moe-router-padding-for-fp8 (ops/router_padding.h): every expert's rows a multiple of 16 after
// the padding, the added assignments are Megatron's (the first unrouted tokens in token order,
// probability 0), and the padded dispatch combines to the unpadded output.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "moecore/ops/permute.h"
#include "moecore/ops/router_padding.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

// Every token picks k distinct experts, skewed towards the low ids (uneven counts).
Tensor skewed_indices(int64_t T, int64_t k, int64_t E, std::mt19937_64& rng) {
  std::vector<int32_t> v;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t j = 0; j < k; ++j) {  // the lower of two draws: low ids more often
      const uint64_t left = static_cast<uint64_t>(E - j);
      const int64_t pick = static_cast<int64_t>(std::min(rng() % left, rng() % left));
      std::swap(perm[static_cast<size_t>(j)], perm[static_cast<size_t>(j + pick)]);
      v.push_back(perm[static_cast<size_t>(j)]);
    }
  }
  return Tensor::from_vector(v, {T, k});
}

}  // namespace

TEST(RouterPadding, EveryExpertAMultipleOfSixteenWithMegatronsTokens) {
  std::mt19937_64 rng(fresh_seed());
  const int64_t T = 96, k = 2, E = 8, m = ops::kFp8RouterPadMultiple;
  const Tensor indices = skewed_indices(T, k, E, rng);
  const Tensor probs = random_tensor({T, k}, DType::F32, Device::cpu(), 0.1, 1.0);
  std::vector<uint8_t> keep(static_cast<size_t>(T * k));
  for (auto& b : keep) b = rng() % 5 != 0;  // some assignments dropped (capacity)
  const Tensor kept = Tensor::from_vector(keep, {T, k});
  const ops::PaddedRouting p = ops::pad_routing_map(indices, probs, kept, E, m);
  const int64_t w = p.indices.size(1);
  ASSERT_GT(w, k);
  EXPECT_EQ(p.topk, k);
  const auto idx = indices.to_vector<int32_t>(), pidx = p.indices.to_vector<int32_t>();
  const auto pr = probs.to_vector<float>(), ppr = p.probs.to_vector<float>();
  const auto pkeep = p.kept.to_vector<uint8_t>();
  // The router's columns unchanged; the added ones probability 0.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < w; ++j) {
      const size_t a = static_cast<size_t>(t * w + j);
      if (j < k) {
        EXPECT_EQ(pidx[a], idx[static_cast<size_t>(t * k + j)]);
        EXPECT_EQ(ppr[a], pr[static_cast<size_t>(t * k + j)]);
        EXPECT_EQ(pkeep[a], keep[static_cast<size_t>(t * k + j)]);
      } else {
        EXPECT_EQ(ppr[a], 0.0f);
      }
    }
  // Per expert: a multiple of 16, and the added tokens are the first ones not routed to it.
  for (int32_t e = 0; e < E; ++e) {
    int64_t routed = 0, total = 0;
    std::vector<int> state(static_cast<size_t>(T), 0);  // 1 routed by the router, 2 added
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < w; ++j) {
        const size_t a = static_cast<size_t>(t * w + j);
        if (!pkeep[a] || pidx[a] != e) continue;
        EXPECT_EQ(state[static_cast<size_t>(t)], 0) << "token " << t << " twice at expert " << e;
        state[static_cast<size_t>(t)] = j < k ? 1 : 2;
        routed += j < k;
        ++total;
      }
    EXPECT_EQ(total % m, 0) << "expert " << e;
    EXPECT_EQ(total - routed, (m - routed % m) % m) << "expert " << e;
    bool gap = false;  // after the first unrouted token left out, none is added
    for (int64_t t = 0; t < T; ++t) {
      if (state[static_cast<size_t>(t)] == 0) gap = true;
      if (state[static_cast<size_t>(t)] == 2) EXPECT_FALSE(gap) << "expert " << e << " token " << t;
    }
  }
  // The plan's rows per expert are multiples of 16 too.
  const ops::MoeRouting r = ops::make_moe_routing(p.indices, p.kept, E);
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(r.host_tokens_per_expert[static_cast<size_t>(e)] % m, 0) << e;
}

TEST(RouterPadding, PaddedDispatchCombinesToTheUnpaddedOutput) {
  std::mt19937_64 rng(fresh_seed());
  const int64_t T = 64, k = 2, E = 4, H = 8;
  const Tensor indices = skewed_indices(T, k, E, rng);
  const Tensor probs = random_tensor({T, k}, DType::F32, Device::cpu(), 0.1, 1.0);
  const Tensor x = random_tensor({T, H}, DType::F32);
  auto dispatch_combine = [&](const Tensor& idx, const Tensor& pr, const Tensor& kept) {
    const ops::MoeRouting r = ops::make_moe_routing(idx, kept, E);
    Tensor rows = Tensor::empty({r.num_rows, H}, DType::F32);
    ops::moe_permute_forward(x, r, rows);
    Tensor out = Tensor::empty({T, H}, DType::F32);
    ops::moe_unpermute_forward(rows, pr, r, out);
    return out.to_vector<float>();
  };
  const ops::PaddedRouting p = ops::pad_routing_map(indices, probs, Tensor(), E, ops::kFp8RouterPadMultiple);
  ASSERT_GT(p.indices.size(1), k);
  EXPECT_EQ(dispatch_combine(p.indices, p.probs, p.kept), dispatch_combine(indices, probs, Tensor()));
}

TEST(RouterPadding, AlignedRoutingIsLeftAsIsAndFewTokensPadWhatThereIs) {
  // 16 tokens, k = 1, all to expert 0: already aligned (expert 1 has none: 0 is a multiple).
  const Tensor idx16 = Tensor::from_vector(std::vector<int32_t>(16, 0), {16, 1});
  const Tensor pr16 = Tensor::from_vector(std::vector<float>(16, 1.0f), {16, 1});
  const ops::PaddedRouting same = ops::pad_routing_map(idx16, pr16, Tensor(), 2, 16);
  EXPECT_EQ(same.indices.size(1), 1);
  EXPECT_FALSE(same.kept.defined());
  // 4 tokens, one at expert 1: the 3 others are all it can get (Megatron's pad_routing_map too).
  const Tensor idx4 = Tensor::from_vector(std::vector<int32_t>{0, 1, 0, 0}, {4, 1});
  const Tensor pr4 = Tensor::from_vector(std::vector<double>{1, 1, 1, 1}, {4, 1});
  const ops::PaddedRouting few = ops::pad_routing_map(idx4, pr4, Tensor(), 2, 16);
  EXPECT_EQ(few.indices.to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 1, 0, 0, 1, 0, 1}));
  EXPECT_EQ(few.kept.to_vector<uint8_t>(), (std::vector<uint8_t>{1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(few.probs.to_vector<double>(), (std::vector<double>{1, 0, 1, 0, 1, 0, 1, 0}));
}
