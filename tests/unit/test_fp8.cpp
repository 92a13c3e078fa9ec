// FP8 quantisation (ops/fp8_quant.h) against the formats' value tables, the emulated FP8 GEMM
// against fp64 within the recipes' error bound, and the delayed-scaling update (model/fp8_linear.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/model/fp8_linear.h"
#include "moecore/ops/fp8_quant.h"
#include "op_harness.h"

using namespace moecore;
using namespace moecore::ops;
using namespace moecore::testing;

namespace {
// Every finite value of a format, from its codes (the dtype table), sorted.
std::vector<double> finite_values(Fp8Format f) {
  std::vector<double> v;
  for (int c = 0; c < 256; ++c) {
    const float x = f == Fp8Format::E4M3 ? e4m3_bits_to_float(static_cast<uint8_t>(c))
                                         : e5m2_bits_to_float(static_cast<uint8_t>(c));
    if (std::isfinite(x)) v.push_back(x);
  }
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

float decode(const Fp8Tensor& t, int64_t i) {
  const uint8_t c = static_cast<const uint8_t*>(t.data.data_ptr())[i];
  return t.format() == Fp8Format::E4M3 ? e4m3_bits_to_float(c) : e5m2_bits_to_float(c);
}

Tensor matrix(const std::vector<float>& v, int64_t r, int64_t c) { return Tensor::from_vector(v, {r, c}); }

double unit_roundoff(Fp8Format f) { return f == Fp8Format::E4M3 ? 1.0 / 16 : 1.0 / 8; }
}  // namespace

class Fp8Formats : public ::testing::TestWithParam<Fp8Format> {};

// Scale 1: each value becomes the nearest table value (ties to the even code), beyond the
// largest finite value it saturates, and every code's value round-trips.
TEST_P(Fp8Formats, RoundsToNearestTableValueAndSaturates) {
  const Fp8Format f = GetParam();
  const std::vector<double> table = finite_values(f);
  const double max = table.back();
  EXPECT_EQ(max, fp8_max(f));
  std::vector<float> xs;
  for (double v : table) xs.push_back(static_cast<float>(v));  // exact values
  for (size_t i = 0; i + 1 < table.size(); ++i) {              // midpoints and near-midpoints
    const double mid = 0.5 * (table[i] + table[i + 1]);
    xs.push_back(static_cast<float>(mid));
    xs.push_back(std::nextafter(static_cast<float>(mid), 1e9f));
    xs.push_back(std::nextafter(static_cast<float>(mid), -1e9f));
  }
  for (float big : {static_cast<float>(max) * 1.01f, 1e6f, -1e9f, INFINITY, -INFINITY}) xs.push_back(big);
  const Tensor x = matrix(xs, 1, static_cast<int64_t>(xs.size()));
  const Fp8Tensor q = quantize_per_tensor(x, 1.0f, f);
  EXPECT_EQ(q.scale_inv.data<float>()[0], 1.0f);
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i], got = decode(q, static_cast<int64_t>(i));
    if (std::fabs(v) >= max) {
      EXPECT_EQ(got, std::copysign(max, v)) << v;
      continue;
    }
    double best = 1e30;
    for (double t : table) best = std::min(best, std::fabs(t - v));
    EXPECT_EQ(std::fabs(got - v), best) << "x=" << v << " got " << got;
  }
}

TEST_P(Fp8Formats, TileAndBlockScalesArePowersOfTwoBelowTheRange) {
  const Fp8Format f = GetParam();
  const Tensor x = random_tensor({130, 300}, DType::F32, Device::cpu(), -3.0, 3.0);
  const Fp8Tensor tiles = quantize_tiles(x, f);
  const Fp8Tensor blocks = quantize_blocks(x, f);
  ASSERT_EQ(tiles.scale_inv.shape(), Shape({130, 3}));
  ASSERT_EQ(blocks.scale_inv.shape(), Shape({2, 3}));
  const std::vector<double> xv = to_doubles(x);
  for (const Fp8Tensor* t : {&tiles, &blocks}) {
    const Tensor back = dequantize(*t);
    const std::vector<double> bv = to_doubles(back);
    for (int64_t i = 0; i < t->scale_inv.numel(); ++i) {
      int e = 0;
      EXPECT_EQ(std::frexp(t->scale_inv.data<float>()[i], &e), 0.5f) << "not a power of two";
    }
    // no saturation (scale <= fp8_max / amax) and one rounding each: |err| <= u |x| or below the
    // subnormal spacing of the tile
    for (size_t i = 0; i < xv.size(); ++i) {
      const int64_t r = static_cast<int64_t>(i) / 300, c = static_cast<int64_t>(i) % 300;
      const float s = t->scaling == Fp8Scaling::Tile1x128 ? t->scale_inv.data<float>()[r * 3 + c / 128]
                                                          : t->scale_inv.data<float>()[(r / 128) * 3 + c / 128];
      const double tiny = s * (f == Fp8Format::E4M3 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -16));
      EXPECT_LE(std::fabs(bv[i] - xv[i]), unit_roundoff(f) * std::fabs(xv[i]) + tiny) << i;
      EXPECT_LE(std::fabs(bv[i] / s), fp8_max(f));
    }
  }
  // The 128x1 tiles of x are the 1x128 tiles of x^T, quantised from the same values.
  const Fp8Tensor tt = quantize_tiles(x, f, true);
  Tensor xt = Tensor::empty({300, 130}, DType::F32);
  for (int64_t r = 0; r < 130; ++r)
    for (int64_t c = 0; c < 300; ++c) xt.data<float>()[c * 130 + r] = x.data<float>()[r * 300 + c];
  const Fp8Tensor ref = quantize_tiles(xt, f);
  EXPECT_EQ(to_doubles(tt.scale_inv), to_doubles(ref.scale_inv));
  EXPECT_EQ(to_doubles(dequantize(tt)), to_doubles(dequantize(ref)));
  // Blocks transpose exactly.
  EXPECT_EQ(to_doubles(dequantize(fp8_transpose(blocks))), to_doubles(dequantize(quantize_blocks(xt, f))));
}

INSTANTIATE_TEST_SUITE_P(All, Fp8Formats, ::testing::Values(Fp8Format::E4M3, Fp8Format::E5M2),
                         [](const auto& i) { return std::string(fp8_format_name(i.param)); });

TEST(Fp8Scale, FollowsTheConvention) {
  EXPECT_EQ(fp8_scale_from_amax(2.0f, Fp8Format::E4M3, false), 224.0f);
  EXPECT_EQ(fp8_scale_from_amax(3.0f, Fp8Format::E4M3, false), 448.0f / 3.0f);
  EXPECT_EQ(fp8_scale_from_amax(3.0f, Fp8Format::E4M3, true), 128.0f);  // 149.3 rounded down
  EXPECT_EQ(fp8_scale_from_amax(1.0f, Fp8Format::E5M2, true), 32768.0f);
  EXPECT_EQ(fp8_scale_from_amax(0.0f, Fp8Format::E4M3, false), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(INFINITY, Fp8Format::E4M3, true), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(NAN, Fp8Format::E4M3, false), 1.0f);
  EXPECT_EQ(fp8_scale_from_amax(1e-40f, Fp8Format::E4M3, false), FLT_MAX);
  const Tensor x = matrix({-3.0f, 1.0f, 0.5f, 2.0f}, 2, 2);
  EXPECT_EQ(amax(x), 3.0f);
  const Fp8Tensor q = quantize_per_tensor(x, 100.0f, Fp8Format::E4M3);
  EXPECT_EQ(q.scale_inv.data<float>()[0], 1.0f / 100.0f);
  EXPECT_EQ(decode(q, 0), -288.0f);  // -300 between -288 and -320 (spacing 32 in [256, 448])
}

// The emulated GEMM against fp64 of the unquantised operands: |C - exact| <= sum_k |a b| (2u + u^2)
// plus fp32 accumulation (1e-5 relative of the same sum); and against fp64 of the dequantised
// operands to fp32 accuracy (the scales are applied per 128-wide K block correctly).
struct GemmCase {
  Fp8Scaling sa, sb;
  Fp8Format fa, fb;
};
class Fp8Gemm : public ::testing::TestWithParam<GemmCase> {};

TEST_P(Fp8Gemm, WithinTheErrorBoundOfFp64) {
  const GemmCase p = GetParam();
  const int64_t m = 37, n = 45, k = 300;
  const Tensor a = random_tensor({m, k}, DType::F32, Device::cpu(), -2.0, 2.0);
  const Tensor b = random_tensor({n, k}, DType::F32, Device::cpu(), -0.05, 0.05);
  auto quant = [](const Tensor& t, Fp8Scaling s, Fp8Format f) {
    return s == Fp8Scaling::PerTensor ? quantize_per_tensor(t, fp8_scale_from_amax(amax(t), f, false), f)
           : s == Fp8Scaling::Tile1x128 ? quantize_tiles(t, f)
                                        : quantize_blocks(t, f);
  };
  const Fp8Tensor qa = quant(a, p.sa, p.fa), qb = quant(b, p.sb, p.fb);
  Tensor c = poisoned({m, n}, DType::F32);
  fp8_gemm(qa, qb, c);
  const std::vector<double> av = to_doubles(a), bv = to_doubles(b), cv = to_doubles(c);
  const std::vector<double> ad = to_doubles(dequantize(qa)), bd = to_doubles(dequantize(qb));
  const double u = std::max(unit_roundoff(p.fa), unit_roundoff(p.fb));
  double worst = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double exact = 0, abs_sum = 0, deq = 0;
      for (int64_t q = 0; q < k; ++q) {
        exact += av[i * k + q] * bv[j * k + q];
        abs_sum += std::fabs(av[i * k + q] * bv[j * k + q]);
        deq += ad[i * k + q] * bd[j * k + q];
      }
      const double got = cv[i * n + j];
      EXPECT_LE(std::fabs(got - exact), abs_sum * (2 * u + u * u + 1e-5)) << i << "," << j;
      EXPECT_LE(std::fabs(got - deq), abs_sum * 1e-5) << i << "," << j;
      worst = std::max(worst, std::fabs(got - exact) / abs_sum);
    }
  EXPECT_GT(worst, 0.0);  // quantisation did happen
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, Fp8Gemm,
    ::testing::Values(GemmCase{Fp8Scaling::PerTensor, Fp8Scaling::PerTensor, Fp8Format::E4M3, Fp8Format::E4M3},
                      GemmCase{Fp8Scaling::PerTensor, Fp8Scaling::PerTensor, Fp8Format::E5M2, Fp8Format::E4M3},
                      GemmCase{Fp8Scaling::Tile1x128, Fp8Scaling::Block128, Fp8Format::E4M3, Fp8Format::E4M3},
                      GemmCase{Fp8Scaling::Tile1x128, Fp8Scaling::Block128, Fp8Format::E5M2, Fp8Format::E4M3},
                      GemmCase{Fp8Scaling::Tile1x128, Fp8Scaling::Tile1x128, Fp8Format::E5M2, Fp8Format::E4M3}));

TEST(Fp8Gemm, BetaAndBf16Output) {
  const Tensor a = matrix({1.0f, 2.0f}, 1, 2), b = matrix({3.0f, 4.0f, 0.5f, 0.25f}, 2, 2);
  const Fp8Tensor qa = quantize_per_tensor(a, 1.0f, Fp8Format::E4M3), qb = quantize_per_tensor(b, 1.0f, Fp8Format::E4M3);
  Tensor c = matrix({10.0f, 20.0f}, 1, 2);
  fp8_gemm(qa, qb, c, 1.0f);
  EXPECT_EQ(to_doubles(c), std::vector<double>({21.0, 21.0}));
  Tensor h = Tensor::empty({1, 2}, DType::BF16);
  fp8_gemm(qa, qb, h);
  EXPECT_EQ(to_doubles(h), std::vector<double>({11.0, 1.0}));
}

TEST(Fp8Gemm, BadOperandsAreRefused) {
  const Tensor a = random_tensor({4, 8}, DType::F32), b = random_tensor({5, 6}, DType::F32);
  const Fp8Tensor qa = quantize_tiles(a, Fp8Format::E4M3), qb = quantize_tiles(b, Fp8Format::E4M3);
  Tensor c = Tensor::empty({4, 5}, DType::F32);
  EXPECT_THROW(fp8_gemm(qa, qb, c), Error);  // K 8 vs 6
  const Fp8Tensor g1 = quantize_tiles(a, Fp8Format::E5M2), g2 = quantize_tiles(a, Fp8Format::E5M2);
  Tensor c4 = Tensor::empty({4, 4}, DType::F32);
  EXPECT_THROW(fp8_gemm(g1, g2, c4), Error);  // E5M2 x E5M2
  Tensor wrong = Tensor::empty({4, 3}, DType::F32);
  EXPECT_THROW(fp8_gemm(qa, quantize_tiles(a, Fp8Format::E4M3), wrong), Error);  // C shape
  EXPECT_THROW(fp8_transpose(qa), Error);                                        // 1x128 tiles
  EXPECT_THROW(quantize_per_tensor(a, 0.0f, Fp8Format::E4M3), Error);            // scale 0
  EXPECT_THROW(quantize_tiles(random_tensor({2, 3, 4}, DType::F32), Fp8Format::E4M3), Error);  // 3-D
  EXPECT_THROW(quantize_tiles(random_tensor({2, 3}, DType::F64), Fp8Format::E4M3), Error);     // f64
}

// Transformer Engine's delayed scaling: history[0] collects the step's amax, the scale comes from
// max(history) (or history[0]), the history rolls by one and history[0] restarts at 0.
TEST(Fp8Delayed, HistoryRollsAndScalesFollowTransformerEngine) {
  for (bool use_max : {true, false}) {
    Fp8Config cfg;
    cfg.enabled = true;
    cfg.recipe = Fp8Config::Recipe::Delayed;
    cfg.amax_history_len = 3;
    cfg.amax_compute_max = use_max;
    Fp8Context ctx(cfg);
    ParamStore store(Device::cpu(), DType::F32, DType::F32, 1);
    const Fp8Linear lin(ctx, store, "l", 1, nullptr, 2, 1);
    const Tensor w = matrix({0.5f, -0.25f}, 1, 2);
    Tensor y = Tensor::empty({1, 1}, DType::F32);
    const Param& hist = store.get("l.fp8_amax_history");
    const Param& scale = store.get("l.fp8_scale");
    const std::vector<float> amaxes = {2.0f, 4.0f, 1.0f, 1.0f, 1.0f};
    const std::vector<float> want_max = {224.0f, 112.0f, 112.0f, 112.0f, 448.0f};
    for (size_t step = 0; step < amaxes.size(); ++step) {
      ctx.set_recording(true);
      lin.forward(matrix({amaxes[step], 0.0f}, 1, 2), w, y);
      ctx.set_recording(false);
      lin.forward(matrix({100.0f, 0.0f}, 1, 2), w, y);  // not recorded (evaluation)
      ctx.finish_step(nullptr, nullptr);
      const float want = use_max ? want_max[step] : 448.0f / amaxes[step];
      EXPECT_EQ(scale.master.data<float>()[0], want) << "step " << step;
      EXPECT_EQ(scale.master.data<float>()[1], 448.0f / 0.5f) << "the weight's scale";
      EXPECT_EQ(hist.master.data<float>()[0], 0.0f);
      EXPECT_EQ(hist.master.data<float>()[2], amaxes[step]) << "the newest amax rolls to the end";
    }
  }
}

// The device-scale per-tensor ops (fp8_quant.h, "Per-tensor scaling state") compute on the CPU
// what the host code computes: the quantiser with the scale read from a tensor equals the one
// given the scale, the amax tensor is amax().
TEST(Fp8DeviceScale, QuantiserEqualsTheHostScaleOne) {
  Tensor x = random_tensor({5, 130}, DType::F32, Device::cpu(), -3.0, 3.0);
  x.data<float>()[7] = 1e-30f;
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    const Tensor a = amax_tensor(x);
    ASSERT_EQ(a.shape(), Shape({1}));
    EXPECT_EQ(a.data<float>()[0], amax(x));
    auto same = [](const Fp8Tensor& p, const Fp8Tensor& q) {
      const auto* pc = static_cast<const uint8_t*>(p.data.data_ptr());
      const auto* qc = static_cast<const uint8_t*>(q.data.data_ptr());
      return std::equal(pc, pc + p.data.numel(), qc) && p.scale_inv.data<float>()[0] == q.scale_inv.data<float>()[0];
    };
    EXPECT_TRUE(same(quantize_per_tensor(x, a, Fp8ScaleFrom::Amax, f),
                     quantize_per_tensor(x, fp8_scale_from_amax(amax(x), f, false), f)));
    const Tensor stored = Tensor::from_vector(std::vector<float>{37.5f}, {1});
    EXPECT_TRUE(same(quantize_per_tensor(x, stored, Fp8ScaleFrom::Stored, f), quantize_per_tensor(x, 37.5f, f)));
    const Tensor none = Tensor::from_vector(std::vector<float>{0.0f}, {1});  // "none yet": scale 1
    EXPECT_TRUE(same(quantize_per_tensor(x, none, Fp8ScaleFrom::Stored, f), quantize_per_tensor(x, 1.0f, f)));
  }
  const Tensor bad = Tensor::from_vector(std::vector<float>{-1.0f}, {1});
  EXPECT_THROW(quantize_per_tensor(x, bad, Fp8ScaleFrom::Stored, Fp8Format::E4M3), Error);
  EXPECT_THROW(quantize_per_tensor(x, Tensor::zeros({2}, DType::F32), Fp8ScaleFrom::Amax, Fp8Format::E4M3), Error);
}

// fp8_gemm takes any M and K (the CUDA op pads them to cuBLASLt's multiples of 16 with zero codes):
// appending zero columns of codes to both operands (K) and zero rows to A (M) changes no product,
// the padding the CUDA op relies on, for every scaling.
TEST(Fp8Gemm, RaggedSizesEqualTheirZeroPaddedProduct) {
  const int64_t m = 37, n = 48, k = 200, mp = 48, kp = 208;
  const Tensor a = random_tensor({m, k}, DType::F32, Device::cpu(), -2.0, 2.0);
  const Tensor b = random_tensor({n, k}, DType::F32, Device::cpu(), -0.5, 0.5);
  auto padded = [](const Tensor& t, int64_t rows, int64_t cols) {
    Tensor p = Tensor::zeros({rows, cols}, DType::F32);
    for (int64_t r = 0; r < t.size(0); ++r)
      std::copy(t.data<float>() + r * t.size(1), t.data<float>() + (r + 1) * t.size(1), p.data<float>() + r * cols);
    return p;
  };
  const Tensor ap = padded(a, mp, kp), bp = padded(b, n, kp);
  for (Fp8Scaling s : {Fp8Scaling::PerTensor, Fp8Scaling::Tile1x128, Fp8Scaling::Block128}) {
    auto quant = [&](const Tensor& t) {
      return s == Fp8Scaling::PerTensor ? quantize_per_tensor(t, fp8_scale_from_amax(amax(t), Fp8Format::E4M3, false), Fp8Format::E4M3)
             : s == Fp8Scaling::Tile1x128 ? quantize_tiles(t, Fp8Format::E4M3)
                                          : quantize_blocks(t, Fp8Format::E4M3);
    };
    Tensor c = Tensor::empty({m, n}, DType::F32), cp = Tensor::empty({mp, n}, DType::F32);
    fp8_gemm(quant(a), quant(b), c);
    fp8_gemm(quant(ap), quant(bp), cp);
    EXPECT_EQ(to_doubles(c), to_doubles(cp.slice(0, 0, m).contiguous())) << static_cast<int>(s);
  }
}

// --fp8-param-gather's blockwise pieces (train/fp8_param_gather.h): a matrix cut into flat pieces,
// each put in a zero matrix; the block amaxes reduced (max) over the pieces give each piece the
// codes and factors of the whole matrix's quantize_blocks, blocks spanning the cuts included.
TEST(Fp8BlockPieces, ReducedBlockAmaxesQuantiseLikeTheWholeMatrix) {
  for (DType dt : {DType::F32, DType::BF16}) {
    const Tensor x = random_tensor({200, 300}, dt, Device::cpu(), -3.0, 3.0);
    const Fp8Tensor whole = quantize_blocks(x, Fp8Format::E4M3);
    const Tensor own = block_amax(x);
    ASSERT_EQ(own.shape(), Shape({2, 3}));
    const Fp8Tensor given = quantize_blocks(x, own, Fp8Format::E4M3);
    EXPECT_EQ(to_doubles(given.scale_inv), to_doubles(whole.scale_inv));
    const auto* wc = static_cast<const uint8_t*>(whole.data.data_ptr());
    EXPECT_TRUE(std::equal(wc, wc + whole.data.numel(), static_cast<const uint8_t*>(given.data.data_ptr())));
    const int64_t n = x.numel(), cuts[] = {0, 12345, 38401, n};  // mid-row, mid-block
    std::vector<Tensor> pieces;
    Tensor reduced = Tensor::zeros({2, 3}, DType::F32);
    for (int i = 0; i < 3; ++i) {
      Tensor p = Tensor::zeros({200, 300}, dt);
      p.view({n}).slice(0, cuts[i], cuts[i + 1]).copy_from(x.view({n}).slice(0, cuts[i], cuts[i + 1]));
      const Tensor a = block_amax(p);
      for (int64_t b = 0; b < 6; ++b)
        reduced.data<float>()[b] = std::max(reduced.data<float>()[b], a.data<float>()[b]);
      pieces.push_back(p);
    }
    for (int i = 0; i < 3; ++i) {
      const Fp8Tensor q = quantize_blocks(pieces[static_cast<size_t>(i)], reduced, Fp8Format::E4M3);
      EXPECT_EQ(to_doubles(q.scale_inv), to_doubles(whole.scale_inv));
      const auto* qc = static_cast<const uint8_t*>(q.data.data_ptr());
      EXPECT_TRUE(std::equal(qc + cuts[i], qc + cuts[i + 1], wc + cuts[i])) << "piece " << i;
    }
  }
  EXPECT_THROW(quantize_blocks(Tensor::zeros({200, 300}, DType::F32), Tensor::zeros({2, 2}, DType::F32), Fp8Format::E4M3),
               Error);
}

// record_amax keeps the maximum in history[row, 0] (a NaN sticks); history_newest reads column 0;
// delayed_scaling_update is Transformer Engine's update (the rows r % 3 == 2 with the gradient's
// fp8_max), margin included.
TEST(Fp8DeviceScale, HistoryOpsFollowTransformerEngine) {
  Tensor h = Tensor::zeros({3, 2}, DType::F32);
  record_amax(matrix({1.0f, -3.0f}, 1, 2), h, 0);
  record_amax(matrix({2.0f, 0.5f}, 1, 2), h, 0);
  record_amax(matrix({0.25f, 0.0f}, 1, 2), h, 2);
  record_amax(matrix({NAN, 1.0f}, 1, 2), h, 1);
  record_amax(matrix({5.0f, 1.0f}, 1, 2), h, 1);
  EXPECT_EQ(h.data<float>()[0], 3.0f);
  EXPECT_TRUE(std::isnan(h.data<float>()[2]));
  EXPECT_EQ(h.data<float>()[4], 0.25f);
  h.data<float>()[1] = 8.0f;  // an older amax
  Tensor newest = Tensor::empty({3}, DType::F32);
  history_newest(h, newest);
  EXPECT_EQ(newest.data<float>()[0], 3.0f);
  EXPECT_EQ(newest.data<float>()[2], 0.25f);
  newest.data<float>()[0] = 4.0f;  // as if another rank saw more
  Tensor scale = Tensor::from_vector(std::vector<float>{0.0f, 2.0f, 5.0f}, {3});
  DelayedScalingUpdate u;
  u.x_w_fp8_max = 448.0f;
  u.grad_fp8_max = 57344.0f;
  u.amax_compute_max = true;
  u.margin = 1;
  delayed_scaling_update(h, scale, newest, u);
  EXPECT_EQ(scale.data<float>()[0], 448.0f / 8.0f / 2.0f);      // max(4, 8), margin 1
  EXPECT_EQ(scale.data<float>()[1], 2.0f);                      // NaN amax: the scale is kept
  EXPECT_EQ(scale.data<float>()[2], 57344.0f / 0.25f / 2.0f);   // a gradient row
  const std::vector<float> rolled = {0.0f, 4.0f, 0.0f, 0.0f, 0.0f, 0.25f};
  for (int i : {0, 1, 4, 5}) EXPECT_EQ(h.data<float>()[i], rolled[static_cast<size_t>(i)]) << i;
  EXPECT_TRUE(std::isnan(h.data<float>()[3]));
  EXPECT_THROW(delayed_scaling_update(h, scale, Tensor::zeros({2}, DType::F32), u), Error);
}
