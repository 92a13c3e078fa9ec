// gpu tier: the Hopper grouped GEMM kernel (ops/grouped_gemm_hopper.cu: TMA + wgmma, persistent,
// tile schedule from device offsets) held to the CPU loop, called directly so a silent fallback
// cannot pass for it. Shapes chosen to hit every edge of the kernel: experts with 0, 1 and
// 129..2200 rows (m-blocks that end inside an expert or run into the next one), N and K that are
// multiples of 8 but not of the tiles (128 x 256 forward/dgrad, 128 x 128 wgrad, 64 deep),
// reductions longer than the ring of stages, more than one raster group of 8 m-blocks with a
// partial last group, and several hundred tiles, so every CTA runs several tiles (on 132 SMs).
// The wgrad's zeroing of the next expert's rows is checked with NaN in those rows. The public
// entry points with MOECORE_GROUPED_GEMM=hopper|mixed are covered by test_gpu_grouped_gemm.cpp
// (including the fallback for unaligned shapes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moecore/core/device.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/grouped_gemm_hopper.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {

// The CPU sums in another order (~sqrt(k) eps of the sum of |products|); bf16 outputs round once.
// f32: these cases check up to 18M outputs at once, and the largest ordering difference among
// so many reaches 1.1e-4 at k = 2200 (seen once, against the earlier 2e-6 sqrt(k) =
// 9.4e-5); 6e-6 sqrt(k) leaves room for that tail while a wrong or missing tile (errors of
// order 0.1-1) still fails.
Tolerance tolerance(DType out, int64_t k) {
  const double scale = std::sqrt(static_cast<double>(std::max<int64_t>(k, 1)));
  if (out == DType::BF16) return {1e-2 * scale, 1e-2};
  return {6e-6 * scale, 1e-5};
}

struct Case {
  std::string name;
  std::vector<int64_t> rows;
  int64_t n, k;
};

std::vector<Case> cases() {
  std::mt19937 gen(fresh_seed());
  std::uniform_int_distribution<int> rows(0, 260);
  std::vector<int64_t> many(64);
  for (auto& r : many) r = rows(gen) < 40 ? 0 : rows(gen);  // ~15% empty experts
  return {
      {"partial_tiles", {300, 0, 129, 1, 64}, 200, 136},
      {"long_reduction", {70, 513, 33}, 128, 1032},
      {"many_experts_more_tiles_than_sms", many, 256, 192},
      {"single_expert", {1000}, 384, 64},
      // 12 x 5 + 18 m-blocks; forward 78 x 5 = 390 tiles, dgrad 78 x 4, wgrad 12 x 10 x 8 (dw has
      // 10 m-blocks: a second, partial raster group); the 2200-row expert: 18 m-blocks, 3 groups.
      {"several_tiles_per_cta_and_raster_groups",
       {600, 600, 600, 2200, 600, 600, 600, 600, 0, 600, 600, 600, 600, 600},
       1280,
       1024},
  };
}

int64_t total(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

Tensor cuda(const Tensor& t) { return t.to(Device::cuda(0)); }
Tensor host(const Tensor& t) { return t.to(Device::cpu()); }

TEST(HopperGroupedGemm, ForwardAndDgradMatchCpu) {
  MC_REQUIRE_CUDA();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const int64_t m = total(c.rows), e = static_cast<int64_t>(c.rows.size());
    Tensor x = random_tensor({m, c.k}, DType::BF16), w = random_tensor({e, c.n, c.k}, DType::BF16);
    Tensor dout = random_tensor({m, c.n}, DType::BF16);
    Tensor out_ref = Tensor::zeros({m, c.n}, DType::BF16), dx_ref = Tensor::zeros({m, c.k}, DType::BF16);
    ops::grouped_gemm_forward(x, w, c.rows, out_ref);
    ops::grouped_gemm_dgrad(dout, w, c.rows, dx_ref);

    Tensor out = poisoned({m, c.n}, DType::BF16, Device::cuda(0)), dx = poisoned({m, c.k}, DType::BF16, Device::cuda(0));
    Tensor xg = cuda(x), wg = cuda(w), dg = cuda(dout);
    ASSERT_TRUE(ops::cuda::hopper_grouped_gemm_forward(xg, wg, c.rows, out)) << "the Hopper kernel did not take the case";
    ASSERT_TRUE(ops::cuda::hopper_grouped_gemm_dgrad(dg, wg, c.rows, dx)) << "the Hopper kernel did not take the case";
    EXPECT_TRUE(all_written(host(out)));
    EXPECT_TRUE(all_written(host(dx)));
    EXPECT_TRUE(allclose(host(out), out_ref, tolerance(DType::BF16, c.k))) << "forward";
    EXPECT_TRUE(allclose(host(dx), dx_ref, tolerance(DType::BF16, c.n))) << "dgrad";
  }
}

// dw += dout_e^T x_e, into f32 and into bf16 gradients; experts without rows keep their slice
// bit for bit (the kernel has no tile for them).
TEST(HopperGroupedGemm, WgradAccumulatesLikeCpuAndLeavesEmptyExpertsAlone) {
  MC_REQUIRE_CUDA();
  for (DType dw_type : {DType::F32, DType::BF16}) {
    for (const Case& c : cases()) {
      SCOPED_TRACE(c.name + " dw " + dtype_name(dw_type));
      const int64_t m = total(c.rows), e = static_cast<int64_t>(c.rows.size());
      Tensor dout = random_tensor({m, c.n}, DType::BF16), x = random_tensor({m, c.k}, DType::BF16);
      Tensor dw0 = random_tensor({e, c.n, c.k}, dw_type);
      Tensor dw_ref = dw0.clone();
      ops::grouped_gemm_wgrad(dout, x, c.rows, dw_ref);

      Tensor dw = cuda(dw0);
      ASSERT_TRUE(ops::cuda::hopper_grouped_gemm_wgrad(cuda(dout), cuda(x), c.rows, dw, true))
          << "the Hopper kernel did not take the case";
      const Tensor got = host(dw);
      const int64_t longest = *std::max_element(c.rows.begin(), c.rows.end());
      EXPECT_TRUE(allclose(got, dw_ref, tolerance(dw_type, longest)));
      const std::vector<double> a = to_doubles(got), b = to_doubles(dw0);
      const size_t slice = static_cast<size_t>(c.n * c.k);
      for (size_t g = 0; g < c.rows.size(); ++g) {
        if (c.rows[g] != 0) continue;
        for (size_t i = g * slice; i < (g + 1) * slice; ++i) ASSERT_EQ(a[i], b[i]) << "empty expert " << g;
      }
    }
  }
}

// Overwriting (accumulate = false), from host counts and from device offsets: dw starts
// poisoned (NaN), every element is written (TMA store, or plain bf16 stores, instead of the
// reduce-add), and experts without rows get tiles of exact zeros.
TEST(HopperGroupedGemm, WgradOverwriteIgnoresOldDwAndZeroesEmptyExperts) {
  MC_REQUIRE_CUDA();
  for (DType dw_type : {DType::F32, DType::BF16}) {
    for (const Case& c : cases()) {
      for (int device_offsets = 0; device_offsets < 2; ++device_offsets) {
        SCOPED_TRACE(c.name + " dw " + dtype_name(dw_type) + (device_offsets ? " device offsets" : " host counts"));
        const int64_t m = total(c.rows), e = static_cast<int64_t>(c.rows.size());
        Tensor dout = random_tensor({m, c.n}, DType::BF16), x = random_tensor({m, c.k}, DType::BF16);
        Tensor dw_ref = Tensor::zeros({e, c.n, c.k}, dw_type);
        ops::grouped_gemm_wgrad(dout, x, c.rows, dw_ref);

        Tensor dw = poisoned({e, c.n, c.k}, dw_type, Device::cuda(0));
        bool ran = false;
        if (device_offsets) {
          std::vector<int32_t> off(1, 0);
          for (int64_t r : c.rows) off.push_back(off.back() + static_cast<int32_t>(r));
          const Tensor offsets = cuda(Tensor::from_vector(off, {e + 1}));
          ran = ops::cuda::hopper_grouped_gemm_wgrad(cuda(dout), cuda(x), offsets, dw, false);
        } else {
          ran = ops::cuda::hopper_grouped_gemm_wgrad(cuda(dout), cuda(x), c.rows, dw, false);
        }
        ASSERT_TRUE(ran) << "the Hopper kernel did not take the case";
        const Tensor got = host(dw);
        EXPECT_TRUE(all_written(got));
        const int64_t longest = *std::max_element(c.rows.begin(), c.rows.end());
        EXPECT_TRUE(allclose(got, dw_ref, tolerance(dw_type, longest)));
        const std::vector<double> a = to_doubles(got);
        const size_t slice = static_cast<size_t>(c.n * c.k);
        for (size_t g = 0; g < c.rows.size(); ++g) {
          if (c.rows[g] != 0) continue;
          for (size_t i = g * slice; i < (g + 1) * slice; ++i) ASSERT_EQ(a[i], 0.0) << "empty expert " << g;
        }
      }
    }
  }
}

// The wgrad's last reduction block of an expert runs into the next expert's rows, which the
// kernel zeroes in shared memory. With finite data, zeroing only one operand would hide a broken
// other; NaN in the next expert's rows of dout only, then of x only, shows either: expert 0's
// slice must stay finite and correct.
TEST(HopperGroupedGemm, WgradIgnoresTheNextExpertsRowsEvenWhenTheyAreNaN) {
  MC_REQUIRE_CUDA();
  const std::vector<int64_t> rows = {100, 60};  // expert 0: 64 + 36 rows, 28 rows of expert 1 in its block
  const int64_t n = 256, k = 128, m = 160;
  for (int poison_dout = 0; poison_dout < 2; ++poison_dout) {
    SCOPED_TRACE(poison_dout ? "NaN in dout" : "NaN in x");
    Tensor dout = random_tensor({m, n}, DType::BF16), x = random_tensor({m, k}, DType::BF16);
    Tensor dw_ref = Tensor::zeros({2, n, k}, DType::F32);
    ops::grouped_gemm_wgrad(dout, x, rows, dw_ref);  // clean data: expert 0's reference
    Tensor& target = poison_dout ? dout : x;
    Tensor nan_rows = poisoned({rows[1], target.size(1)}, DType::BF16);
    target.slice(0, rows[0], m).copy_from(nan_rows);
    Tensor dw = Tensor::zeros({2, n, k}, DType::F32, Device::cuda(0));
    ASSERT_TRUE(ops::cuda::hopper_grouped_gemm_wgrad(cuda(dout), cuda(x), rows, dw, true));
    const Tensor got = host(dw).slice(0, 0, 1).contiguous(), want = dw_ref.slice(0, 0, 1).contiguous();
    EXPECT_TRUE(allclose(got, want, tolerance(DType::F32, rows[0])));
  }
}

// Every forward tile (the 64-row ones split the columns between the warpgroups) on the cases
// above and on decoding's shapes: a handful of rows per expert, some experts empty.
TEST(HopperGroupedGemm, EveryForwardTileMatchesCpu) {
  MC_REQUIRE_CUDA();
  std::vector<Case> all = cases();
  all.push_back({"decode_16_prompts_top2", {5, 3, 0, 8, 4, 2, 6, 4}, 1152, 2048});
  all.push_back({"decode_one_row_per_expert", {1, 0, 1, 0}, 520, 264});
  using ops::cuda::hopper::ForwardTile;
  for (ForwardTile tile : {ForwardTile::Wide128, ForwardTile::Narrow128, ForwardTile::Rows64Wide, ForwardTile::Rows64Narrow}) {
    for (const Case& c : all) {
      SCOPED_TRACE(c.name + " on the " + ops::cuda::hopper::forward_tile_name(tile) + " tile");
      const int64_t m = total(c.rows), e = static_cast<int64_t>(c.rows.size());
      Tensor x = random_tensor({m, c.k}, DType::BF16), w = random_tensor({e, c.n, c.k}, DType::BF16);
      Tensor out_ref = Tensor::zeros({m, c.n}, DType::BF16);
      ops::grouped_gemm_forward(x, w, c.rows, out_ref);
      std::vector<int32_t> off(1, 0);
      for (int64_t r : c.rows) off.push_back(off.back() + static_cast<int32_t>(r));
      Tensor offsets = Tensor::from_vector(off, {e + 1}, Device::cuda(0));
      Tensor out = poisoned({m, c.n}, DType::BF16, Device::cuda(0)), xg = cuda(x), wg = cuda(w);
      ASSERT_TRUE(ops::cuda::hopper::available(xg, wg, out, e));
      auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda(0)).handle());
      ops::cuda::hopper::grouped_gemm(ops::cuda::hopper::GroupedMode::Forward, xg, wg, out, offsets.data<int32_t>(),
                                      static_cast<int>(e), stream, true, tile);
      EXPECT_TRUE(all_written(host(out)));
      EXPECT_TRUE(allclose(host(out), out_ref, tolerance(DType::BF16, c.k)));
    }
  }
}

// Auto: the wide tile at training's rows per expert, 64-row tiles at decoding's.
TEST(HopperGroupedGemm, AutoTileFollowsRowsPerExpert) {
  using ops::cuda::hopper::ForwardTile;
  using ops::cuda::hopper::auto_forward_tile;
  EXPECT_EQ(auto_forward_tile(8192 * 2, 8, 11264, 132), ForwardTile::Wide128);  // mixtral-small training
  EXPECT_EQ(auto_forward_tile(16384 * 8, 64, 1024, 132), ForwardTile::Wide128);  // finegrained-small training
  EXPECT_EQ(auto_forward_tile(32, 8, 11264, 132), ForwardTile::Rows64Narrow);    // 16 prompts, top-2: fc1
  EXPECT_EQ(auto_forward_tile(128, 8, 11264, 132), ForwardTile::Rows64Wide);     // 64 prompts: fc1
  EXPECT_EQ(auto_forward_tile(128, 8, 2048, 132), ForwardTile::Rows64Narrow);    // fc2: 64 wide tiles
}

// The kernel declines what it cannot do (the caller then loops): f32 inputs, a last dimension
// that is not a multiple of 8 (TMA row strides), a non-contiguous weight.
TEST(HopperGroupedGemm, DeclinesUnsupportedCases) {
  MC_REQUIRE_CUDA();
  const Device d = Device::cuda(0);
  Tensor x32 = Tensor::zeros({8, 64}, DType::F32, d), w32 = Tensor::zeros({2, 16, 64}, DType::F32, d);
  Tensor o32 = Tensor::zeros({8, 16}, DType::F32, d);
  EXPECT_FALSE(ops::cuda::hopper_grouped_gemm_forward(x32, w32, {4, 4}, o32));
  Tensor x = Tensor::zeros({8, 60}, DType::BF16, d), w = Tensor::zeros({2, 16, 60}, DType::BF16, d);
  Tensor o = Tensor::zeros({8, 16}, DType::BF16, d);
  EXPECT_FALSE(ops::cuda::hopper_grouped_gemm_forward(x, w, {4, 4}, o));
  Tensor w_wide = Tensor::zeros({2, 32, 64}, DType::BF16, d), x64 = Tensor::zeros({8, 64}, DType::BF16, d);
  Tensor w_view = w_wide.slice(1, 0, 16);  // [2, 16, 64] with the strides of [2, 32, 64]
  EXPECT_FALSE(ops::cuda::hopper_grouped_gemm_forward(x64, w_view, {4, 4}, o));
}

}  // namespace
