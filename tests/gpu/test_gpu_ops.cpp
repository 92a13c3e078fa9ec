// gpu tier: every CUDA op held to its CPU op on fresh random inputs (op_harness), plus the
// CUDA pieces of core/: allocator statistics, streams and events, pinned copies, Philox.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "moecore/core/allocator.h"
#include "moecore/core/philox.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/gemm.h"
#include "moecore/ops/random.h"
#include "moecore/ops/reduce.h"
#include "moecore/ops/softmax.h"
#include "moecore/ops/swiglu.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::testing;

namespace {
const Device kCuda = Device::cuda(0);

// GEMM tolerance: the CPU and cuBLASLt sum K products in different orders. For f32 that is
// ~sqrt(K) * 6e-8 relative to the sum of |products| (our inputs are U(-1,1): |C| ~ sqrt(K)/3),
// so atol scales with sqrt(K). bf16 outputs add one bf16 rounding (0.4%).
Tolerance gemm_tolerance(DType out, int64_t k) {
  const double scale = std::sqrt(static_cast<double>(k));
  if (out == DType::BF16) return {1e-2 * scale, 1e-2};
  return {2e-6 * scale, 1e-5};
}
}  // namespace

// ---- GEMM ----------------------------------------------------------------------------
struct GemmCase {
  DType in, out;
  bool ta, tb;
};

class GpuGemm : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GpuGemm, MatchesCpu) {
  MC_REQUIRE_CUDA();
  const GemmCase p = GetParam();
  // Odd sizes catch edge tiles; a second size exercises a bigger, aligned shape.
  for (const auto& [m, n, k] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{67, 45, 131}, {256, 384, 512}}) {
    Tensor a = random_tensor(p.ta ? Shape{k, m} : Shape{m, k}, p.in);
    Tensor b = random_tensor(p.tb ? Shape{n, k} : Shape{k, n}, p.in);
    expect_cuda_matches_cpu({a, b}, {{{m, n}, p.out}},
                            [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::gemm(in[0], in[1], out[0], p.ta, p.tb);
                            },
                            {gemm_tolerance(p.out, k)});
  }
}

TEST_P(GpuGemm, AccumulatesWithBeta) {
  MC_REQUIRE_CUDA();
  const GemmCase p = GetParam();
  const int64_t m = 40, n = 72, k = 96;
  Tensor a = random_tensor(p.ta ? Shape{k, m} : Shape{m, k}, p.in);
  Tensor b = random_tensor(p.tb ? Shape{n, k} : Shape{k, n}, p.in);
  Tensor c0 = random_tensor({m, n}, p.out);
  // C starts from c0 on both devices: C = 0.5 * AB + 2 * c0.
  expect_cuda_matches_cpu({a, b, c0}, {{{m, n}, p.out}},
                          [&](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                            out[0].copy_from(in[2]);
                            ops::gemm(in[0], in[1], out[0], p.ta, p.tb, 0.5f, 2.0f);
                          },
                          {gemm_tolerance(p.out, k)});
}

std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> v;
  for (auto [in, out] : std::vector<std::pair<DType, DType>>{
           {DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) v.push_back({in, out, ta, tb});
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllTransposes, GpuGemm, ::testing::ValuesIn(gemm_cases()),
                         [](const ::testing::TestParamInfo<GemmCase>& i) {
                           return std::string(dtype_name(i.param.in)) + "_to_" + dtype_name(i.param.out) +
                                  (i.param.ta ? "_tA" : "_nA") + (i.param.tb ? "_tB" : "_nB");
                         });

TEST(GpuGemm, BetaZeroIgnoresNanInOutput) {
  MC_REQUIRE_CUDA();
  Tensor a = random_tensor({8, 8}, DType::BF16, kCuda), b = random_tensor({8, 8}, DType::BF16, kCuda);
  Tensor c = poisoned({8, 8}, DType::BF16, kCuda);
  ops::gemm(a, b, c, false, false);
  EXPECT_TRUE(all_written(c));
}

TEST(GpuGemm, F64IsRefusedOnCuda) {
  MC_REQUIRE_CUDA();
  Tensor a = Tensor::zeros({4, 4}, DType::F64, kCuda);
  Tensor c = Tensor::zeros({4, 4}, DType::F64, kCuda);
  try {
    ops::gemm(a, a, c, false, false);
    FAIL() << "f64 gemm on CUDA did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f64 is CPU-only"), std::string::npos) << e.what();
  }
}

// ---- dtype conversion (cast) ----------------------------------------------------------
TEST(GpuCast, EveryPairMatchesCpuBitForBit) {
  MC_REQUIRE_CUDA();
  const std::vector<DType> types = {DType::F32, DType::BF16, DType::FP8E4M3, DType::FP8E5M2};
  // Random values across fp8's range plus the special cases: zeros, ties, overflow, inf.
  // (NaN is left out: the poison check reads NaN as "not written"; the exhaustive intrinsic
  // tests cover NaN inputs.)
  Tensor base = random_tensor({4096}, DType::F32, Device::cpu(), -600.0, 600.0);
  std::vector<float> v = base.to_vector<float>();
  const float specials[] = {0.0f, -0.0f, 448.0f, 464.0f, 480.0f, -1e9f, 57344.0f, 61440.0f, 1e-9f, 0.0009765625f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            1.0f + 1.0f / 16, 1.0f + 3.0f / 16};
  for (size_t i = 0; i < std::size(specials); ++i) v[i] = specials[i];
  const Tensor src_f32 = Tensor::from_vector(v, {4096});
  for (DType from : types) {
    Tensor src = Tensor::empty({4096}, from);
    ops::cast(src_f32, src);
    for (DType to : types) {
      // tolerance 0: conversions are the same function on both devices.
      expect_cuda_matches_cpu({src}, {{{4096}, to}},
                              [](const std::vector<Tensor>& in, std::vector<Tensor>& out) { ops::cast(in[0], out[0]); },
                              {{0.0, 0.0}});
      if (HasFailure()) FAIL() << "cast " << dtype_name(from) << " -> " << dtype_name(to);
    }
  }
}

// ---- elementwise ----------------------------------------------------------------------
class GpuElementwise : public ::testing::TestWithParam<DType> {};

TEST_P(GpuElementwise, BinaryOpsMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const Tolerance tol = default_tolerance(t);
  Tensor a = random_tensor({3, 1001}, t), b = random_tensor({3, 1001}, t);
  expect_cuda_matches_cpu({a, b}, {{{3, 1001}, t}, {{3, 1001}, t}, {{3, 1001}, t}},
                          [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                            ops::add(in[0], in[1], out[0]);
                            ops::mul(in[0], in[1], out[1]);
                            ops::axpby(0.75f, in[0], -1.5f, in[1], out[2]);
                          },
                          {tol});
}

TEST_P(GpuElementwise, ActivationsMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const Tolerance tol = default_tolerance(t);
  Tensor x = random_tensor({5000}, t, Device::cpu(), -6.0, 6.0), dy = random_tensor({5000}, t);
  expect_cuda_matches_cpu({x, dy}, {{{5000}, t}, {{5000}, t}, {{5000}, t}, {{5000}, t}, {{5000}, t}, {{5000}, t}},
                          [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                            ops::silu_forward(in[0], out[0]);
                            ops::silu_backward(in[0], in[1], out[1]);
                            ops::gelu_forward(in[0], out[2]);
                            ops::gelu_backward(in[0], in[1], out[3]);
                            ops::sigmoid_forward(in[0], out[4]);
                            ops::sigmoid_backward(in[0], in[1], out[5]);
                          },
                          {tol});
}

TEST_P(GpuElementwise, FillMatchesCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  expect_cuda_matches_cpu({}, {{{777}, t}},
                          [](const std::vector<Tensor>&, std::vector<Tensor>& out) { ops::fill(out[0], -0.3); },
                          {{0.0, 0.0}});
}

// Views one element into their buffers are not aligned to the kernels' 8-element packs: the
// one-element path runs (offset 1), and at offset 0 the packed path with a tail (4092 = 8 * 511
// + 4 elements); both equal the CPU (the cast and the fill exactly).
TEST_P(GpuElementwise, UnalignedViewsAndTailsMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  const int64_t n = 4093;
  const Tensor a = random_tensor({n + 1}, t, Device::cpu(), -3.0, 3.0), b = random_tensor({n + 1}, t);
  for (int64_t offset : {0, 1}) {
    SCOPED_TRACE(offset);
    std::vector<std::vector<double>> results[2];
    for (int d = 0; d < 2; ++d) {
      const Device dev = d == 0 ? Device::cpu() : kCuda;
      const Tensor ad = a.to(dev), bd = b.to(dev);
      const Tensor av = ad.slice(0, offset, offset + n - 1), bv = bd.slice(0, offset, offset + n - 1);
      Tensor sum_buf = Tensor::zeros({n + 1}, t, dev), act_buf = Tensor::zeros({n + 1}, t, dev);
      Tensor cast_buf = Tensor::zeros({n + 1}, DType::F32, dev), fill_buf = Tensor::zeros({n + 1}, t, dev);
      Tensor sum = sum_buf.slice(0, offset, offset + n - 1), act = act_buf.slice(0, offset, offset + n - 1);
      Tensor cast = cast_buf.slice(0, offset, offset + n - 1), fill = fill_buf.slice(0, offset, offset + n - 1);
      ops::add(av, bv, sum);
      ops::silu_backward(av, bv, act);
      ops::cast(av, cast);
      ops::fill(fill, 0.7);
      // Mixed alignment: a packable first operand with an unpackable second (offset 0 and 1).
      Tensor mixed_buf = Tensor::zeros({n + 1}, t, dev);
      Tensor mixed = mixed_buf.slice(0, 0, n - 1);
      ops::mul(ad.slice(0, 0, n - 1), bd.slice(0, 1, n), mixed);
      for (const Tensor* r : {&sum_buf, &act_buf, &cast_buf, &fill_buf, &mixed_buf}) results[d].push_back(to_doubles(*r));
    }
    const Tolerance tol = default_tolerance(t);
    ASSERT_EQ(results[0].size(), 5u);
    for (size_t k = 0; k < results[0].size(); ++k)
      for (size_t i = 0; i < results[0][k].size(); ++i) {
        const double e = results[0][k][i], g = results[1][k][i];
        const bool exact = k == 2 || k == 3;  // the cast and the fill
        ASSERT_LE(std::fabs(g - e), exact ? 0.0 : tol.atol + tol.rtol * std::fabs(e)) << "output " << k << " element " << i;
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuElementwise, ::testing::Values(DType::F32, DType::BF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

// ---- reductions -----------------------------------------------------------------------
class GpuReduce : public ::testing::TestWithParam<DType> {};

TEST_P(GpuReduce, RowColumnAndTotalReductionsMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  // Sums of up to ~5000 terms of U(-1,1) accumulated in fp32 in another order: errors of
  // ~sqrt(n) * 6e-8 * n-ish magnitudes, so atol 1e-3 for totals and 1e-4 for rows.
  const int64_t rows = 37, cols = 5003;
  Tensor x = random_tensor({rows, cols}, t);
  expect_cuda_matches_cpu({x}, {{{rows}, DType::F32}, {{rows}, t}, {{cols}, DType::F32}, {{1}, DType::F32},
                               {{1}, DType::F32}},
                          [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                            ops::sum_last_dim(in[0], out[0]);
                            ops::max_last_dim(in[0], out[1]);
                            ops::sum_leading_dims(in[0], out[2]);
                            ops::sum_all(in[0], out[3]);
                            ops::sum_squares(in[0], out[4]);
                          },
                          {Tolerance{1e-4, 1e-5}, default_tolerance(t), Tolerance{1e-4, 1e-5}, Tolerance{1e-2, 1e-5},
                           Tolerance{1e-2, 1e-5}});
}

TEST_P(GpuReduce, TotalsAreReproducible) {
  MC_REQUIRE_CUDA();
  Tensor x = random_tensor({1 << 20}, GetParam(), kCuda);
  Tensor a = Tensor::empty({1}, DType::F32, kCuda), b = Tensor::empty({1}, DType::F32, kCuda);
  ops::sum_squares(x, a);
  ops::sum_squares(x, b);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuReduce, ::testing::Values(DType::F32, DType::BF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

// ---- softmax --------------------------------------------------------------------------
class GpuSoftmax : public ::testing::TestWithParam<DType> {};

TEST_P(GpuSoftmax, ForwardAndBackwardMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  for (int64_t cols : {7, 128, 32768 + 3}) {
    Tensor x = random_tensor({9, cols}, t, Device::cpu(), -8.0, 8.0), dy = random_tensor({9, cols}, t);
    Tensor y = Tensor::empty({9, cols}, t);
    ops::softmax_forward(x, y);
    expect_cuda_matches_cpu({x, y, dy}, {{{9, cols}, t}, {{9, cols}, t}},
                            [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::softmax_forward(in[0], out[0]);
                              ops::softmax_backward(in[1], in[2], out[1]);
                            },
                            {Tolerance{1e-6, t == DType::F32 ? 1e-5 : 1e-2}});
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuSoftmax, ::testing::Values(DType::F32, DType::BF16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

// ---- SwiGLU ---------------------------------------------------------------------------
TEST_P(GpuSoftmax, SwigluForwardAndBackwardMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  // F = 96: the 16-byte vector path; F = 37: the scalar path.
  for (int64_t f : {96, 37}) {
    SCOPED_TRACE("F=" + std::to_string(f));
    Tensor x = random_tensor({333, 2 * f}, t, Device::cpu(), -4, 4), dy = random_tensor({333, f}, t);
    expect_cuda_matches_cpu({x, dy}, {{{333, f}, t}, {{333, 2 * f}, t}},
                            [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::swiglu_forward(in[0], out[0]);
                              ops::swiglu_backward(in[0], in[1], out[1]);
                            },
                            {default_tolerance(t)});
  }
}

// Weighted (the MoE experts' activation): F = 96 and 1536 on the warp-per-row 16-byte path, 37
// on its scalar path. dw sums F products in another order than the CPU: atol grows like sqrt(F).
TEST_P(GpuSoftmax, WeightedSwigluForwardAndBackwardMatchCpu) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  for (int64_t f : {96, 1536, 37}) {
    SCOPED_TRACE("F=" + std::to_string(f));
    Tensor x = random_tensor({333, 2 * f}, t, Device::cpu(), -4, 4), dy = random_tensor({333, f}, t);
    Tensor w = random_tensor({333, 1}, DType::F32, Device::cpu(), 0, 1);
    const Tolerance dot_tol{2e-5 * std::sqrt(static_cast<double>(f)), 1e-5};
    expect_cuda_matches_cpu({x, w, dy}, {{{333, f}, t}, {{333, 2 * f}, t}, {{333, 1}, DType::F32}},
                            [](const std::vector<Tensor>& in, std::vector<Tensor>& out) {
                              ops::weighted_swiglu_forward(in[0], in[1], out[0]);
                              ops::weighted_swiglu_backward(in[0], in[1], in[2], out[1], out[2]);
                            },
                            {default_tolerance(t), default_tolerance(t), dot_tol});
  }
}

// Weight 1 on the GPU: the unweighted kernels' outputs bit for bit (the same products times 1);
// F = 0: every row's weight gradient is 0 (an empty sum).
TEST_P(GpuSoftmax, WeightedSwigluWithUnitWeightsIsTheUnweightedOp) {
  MC_REQUIRE_CUDA();
  const DType t = GetParam();
  for (int64_t f : {96, 37}) {
    SCOPED_TRACE("F=" + std::to_string(f));
    Tensor x = random_tensor({65, 2 * f}, t, kCuda, -4, 4), dy = random_tensor({65, f}, t, kCuda);
    Tensor ones = Tensor::from_vector(std::vector<float>(65, 1.0f), {65, 1}).to(kCuda);
    Tensor y = Tensor::empty({65, f}, t, kCuda), yw = Tensor::empty({65, f}, t, kCuda);
    Tensor dx = Tensor::empty({65, 2 * f}, t, kCuda), dxw = Tensor::empty({65, 2 * f}, t, kCuda);
    Tensor dw = Tensor::empty({65, 1}, DType::F32, kCuda);
    ops::swiglu_forward(x, y);
    ops::weighted_swiglu_forward(x, ones, yw);
    ops::swiglu_backward(x, dy, dx);
    ops::weighted_swiglu_backward(x, ones, dy, dxw, dw);
    EXPECT_EQ(to_doubles(y), to_doubles(yw));
    EXPECT_EQ(to_doubles(dx), to_doubles(dxw));
  }
  Tensor x0 = Tensor::zeros({5, 0}, t, kCuda), dy0 = Tensor::zeros({5, 0}, t, kCuda), dx0 = Tensor::zeros({5, 0}, t, kCuda);
  Tensor w = Tensor::from_vector(std::vector<float>(5, 0.5f), {5, 1}).to(kCuda);
  Tensor dw0 = poisoned({5, 1}, DType::F32, kCuda);
  ops::weighted_swiglu_backward(x0, w, dy0, dx0, dw0);
  EXPECT_EQ(dw0.to_vector<float>(), std::vector<float>(5, 0.0f));
}

// ---- Philox ---------------------------------------------------------------------------
TEST(GpuPhilox, UniformsAreBitIdenticalToCpu) {
  MC_REQUIRE_CUDA();
  for (DType t : {DType::F32, DType::BF16}) {
    expect_cuda_matches_cpu({}, {{{1 << 16}, t}},
                            [](const std::vector<Tensor>&, std::vector<Tensor>& out) {
                              ops::fill_uniform(out[0], 7, rng_key("w"), -0.5, 2.0, 12345);
                            },
                            {{0.0, 0.0}});
  }
}

TEST(GpuPhilox, NormalsAgreeWithCpuToTheLastBit) {
  MC_REQUIRE_CUDA();
  // Box-Muller in double: device log/cos may differ from glibc's in the last double bit, which
  // after rounding to float changes at most one float ulp, and almost never.
  Tensor g = Tensor::empty({1 << 20}, DType::F32, kCuda), c = Tensor::empty({1 << 20}, DType::F32);
  ops::fill_normal(g, 99, rng_key("layers.3.experts.fc1"), 0.0, 0.02, 1000);
  ops::fill_normal(c, 99, rng_key("layers.3.experts.fc1"), 0.0, 0.02, 1000);
  const std::vector<float> gv = g.to_vector<float>(), cv = c.to_vector<float>();
  int64_t differing = 0;
  for (size_t i = 0; i < gv.size(); ++i) {
    if (gv[i] != cv[i]) {
      ++differing;
      EXPECT_LE(std::fabs(gv[i] - cv[i]), std::fabs(cv[i]) * 1.2e-7f) << "element " << i;
    }
  }
  EXPECT_LE(differing, 16) << "more normals differ than last-bit rounding explains";
}

// ---- core: allocator, streams, events, pinned memory ---------------------------------
TEST(GpuCore, AllocatorCachesAndCounts) {
  MC_REQUIRE_CUDA();
  CachingAllocator& alloc = cuda_allocator(0);
  synchronize(kCuda);
  const AllocatorStats before = alloc.stats();
  {
    Tensor t = Tensor::empty({1 << 20}, DType::F32, kCuda);  // 4 MiB
    const AllocatorStats during = alloc.stats();
    EXPECT_EQ(during.allocated_bytes - before.allocated_bytes, 4 << 20);
    EXPECT_GE(during.peak_allocated_bytes, during.allocated_bytes);
    EXPECT_EQ(during.num_allocs - before.num_allocs, 1);
  }
  const AllocatorStats after_free = alloc.stats();
  EXPECT_EQ(after_free.allocated_bytes, before.allocated_bytes);
  Tensor again = Tensor::empty({1 << 20}, DType::F32, kCuda);
  const AllocatorStats reuse = alloc.stats();
  EXPECT_EQ(reuse.num_cache_hits - after_free.num_cache_hits, 1) << "the freed 4 MiB block was not reused";
  EXPECT_EQ(reuse.num_backend_allocs, after_free.num_backend_allocs);
}

TEST(GpuCore, OutOfMemoryIsAClearError) {
  MC_REQUIRE_CUDA();
  try {
    Tensor t = Tensor::empty({int64_t(1) << 40}, DType::F32, kCuda);  // 4 TiB
    FAIL() << "a 4 TiB allocation succeeded";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cuda:0 out of memory: tried to allocate"), std::string::npos) << msg;
  }
  Tensor small = Tensor::empty({1024}, DType::F32, kCuda);  // the device still works afterwards
  ops::fill(small, 1.0);
  EXPECT_EQ(small.to_vector<float>()[1023], 1.0f);
}

// f64 fills (the step decisions' skip counter) keep the value as given: a float round trip would
// turn 0.1 into 0.10000000149011612.
TEST(GpuOps, FillF64EqualsCpu) {
  MC_REQUIRE_CUDA();
  for (const double v : {0.0, 0.1, -3.0e300}) {
    Tensor gpu = Tensor::empty({1027}, DType::F64, kCuda), cpu = Tensor::empty({1027}, DType::F64);
    ops::fill(gpu, v);
    ops::fill(cpu, v);
    EXPECT_EQ(gpu.to_vector<double>(), cpu.to_vector<double>()) << v;
    EXPECT_EQ(gpu.to_vector<double>()[1026], v);
  }
}

TEST(GpuCore, StreamsEventsAndPinnedCopies) {
  MC_REQUIRE_CUDA();
  Stream side = Stream::create(kCuda);
  {
    StreamGuard guard(side);
    EXPECT_EQ(current_stream(kCuda).handle(), side.handle());
    Tensor host = Tensor::empty_pinned({1 << 16}, DType::F32);
    EXPECT_TRUE(host.is_pinned());
    ops::fill_uniform(host, 5, rng_key("pinned"), 0, 1);
    Event start(kCuda), stop(kCuda);
    start.record();
    Tensor dev = host.to(kCuda);  // asynchronous on `side`
    Tensor back = Tensor::empty_pinned({1 << 16}, DType::F32);
    back.copy_from(dev);
    stop.record();
    stop.synchronize();
    EXPECT_GE(stop.elapsed_ms_since(start), 0.0f);
    EXPECT_EQ(back.to_vector<float>(), host.to_vector<float>());
  }
  EXPECT_EQ(current_stream(kCuda).handle(), nullptr) << "StreamGuard did not restore the default stream";
  side.destroy();
}

TEST(GpuCore, DeviceToDeviceCopyAndViews) {
  MC_REQUIRE_CUDA();
  Tensor x = random_tensor({6, 10}, DType::F32, kCuda);
  Tensor rows = x.slice(0, 2, 5);  // contiguous view of rows 2..4
  Tensor copy = rows.clone();
  const std::vector<float> all = x.to_vector<float>(), part = copy.to_vector<float>();
  ASSERT_EQ(part.size(), 30u);
  for (size_t i = 0; i < part.size(); ++i) EXPECT_EQ(part[i], all[20 + i]);
}

// Sequence slices of [B, S, H, D] are row-pitched: contiguous() and copy_from into such a slice
// run as one 2-D copy and must equal the host's strided copy.
TEST(GpuCore, RowPitchedSliceCopies) {
  MC_REQUIRE_CUDA();
  const Tensor host = random_tensor({3, 8, 2, 5}, DType::F32, Device::cpu());
  const Tensor dev = host.to(kCuda);
  const Tensor expect = host.slice(1, 2, 6).contiguous();
  EXPECT_EQ(dev.slice(1, 2, 6).contiguous().to_vector<float>(), expect.to_vector<float>());
  // Write a packed block into the middle of another tensor's sequence.
  Tensor target = Tensor::zeros({3, 8, 2, 5}, DType::F32, kCuda);
  Tensor window = target.slice(1, 3, 7);
  window.copy_from(expect.to(kCuda));
  Tensor host_target = Tensor::zeros({3, 8, 2, 5}, DType::F32, Device::cpu());
  Tensor host_window = host_target.slice(1, 3, 7);
  host_window.copy_from(expect);
  EXPECT_EQ(target.to_vector<float>(), host_target.to_vector<float>());
  // A transpose is not row-pitched: refused with a message.
  EXPECT_THROW(dev.transpose(0, 1).contiguous(), Error);
}
