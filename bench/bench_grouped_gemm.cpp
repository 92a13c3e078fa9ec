// Grouped GEMM benchmark: the expert GEMMs of a MoE layer (ops/grouped_gemm.h) at the issue's
// two shapes, each through
//   grouped  one cublasGemmGroupedBatchedEx call (GroupedGemmImpl::Grouped; the bf16 -> f32
//            wgrad falls back to the loop where cuBLAS refuses that type combination)
//   loop     one cuBLASLt ops::gemm per expert (GroupedGemmImpl::Loop)
//   hopper   our sm_90a kernel, one persistent launch over all experts (GroupedGemmImpl::Hopper,
//            ops/grouped_gemm_hopper.cu); its output is compared with the loop's at the real
//            shape ("hopper_rel_err": max |hopper - loop| / max |loop| over a strided sample;
//            "hopper_ran": false, and "declined" in the table, where the kernel did not take the
//            case and the "hopper" figures are the loop's)
//   dense    the ceiling: one ops::gemm over all rows (same FLOPs: M = sum of the expert rows,
//            expert 0's weight; for wgrad the reduction runs over all rows into one dw slice)
// for balanced and skewed token counts per expert.
//
// Shapes (T tokens, top-k, E experts, hidden h, expert FFN f, SwiGLU so fc1 is [E, 2f, h]):
//   mixtral  h4096 f14336 E8   k2  T8192    (Mixtral-8x7B experts)
//   qwen3    h2048 f768   E128 k8  T16384   (Qwen3-30B-A3B experts)
// GEMMs (M = T k rows in expert order): fc1 fwd [M,h]x[E,2f,h]^T, fc2 fwd [M,f]x[E,h,f]^T,
// fc1/fc2 dgrad (bf16 out) and wgrad (fp32 dw, beta = 1: the training path's accumulation).
// Skewed: expert e gets a share proportional to exp(-3 r_e / (E-1)) for a fixed permutation r of
// the experts (hottest/coldest = e^3 = 20x), and the coldest expert gets no tokens.
//
// bf16 in, fp32 accumulate. Timing: CUDA events around `iters` back-to-back calls after warm-up,
// the median of `repeats` runs. Without a CUDA device it prints one line saying so.
//   mixtral-small      h2048 f5632 E8  k2 T8192    (configs/mixtral-small.yaml, micro-batch 4)   --presets
//   finegrained-small  h1024 f512  E64 k8 T16384   (configs/finegrained-small.yaml, micro-batch 8)
// (the presets' shapes have no target; they measure which implementation each GEMM should take).
// Flags: --repeats N, --quick (qwen3 balanced only), --presets (add the two presets' shapes),
// --shapes NAME... (only these of the shapes above, by their first word), --balanced-only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_timing.h"
#include "moecore/cli/flags.h"
#include "moecore/core/philox.h"
#include "moecore/core/system_info.h"
#include "moecore/core/tensor.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/gemm.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/random.h"

using namespace moecore;
using moecore::bench::time_ms;

namespace {

struct Shape5 {
  std::string name;
  int64_t h, f, experts, topk, tokens;
  double target_pct;  // the target: grouped >= this % of dense
};

enum class Gemm { Fc1Fwd, Fc2Fwd, Fc1Dgrad, Fc1Wgrad, Fc2Dgrad, Fc2Wgrad };
const char* gemm_name(Gemm g) {
  switch (g) {
    case Gemm::Fc1Fwd: return "fc1 fwd";
    case Gemm::Fc2Fwd: return "fc2 fwd";
    case Gemm::Fc1Dgrad: return "fc1 dgrad";
    case Gemm::Fc1Wgrad: return "fc1 wgrad";
    case Gemm::Fc2Dgrad: return "fc2 dgrad";
    case Gemm::Fc2Wgrad: return "fc2 wgrad";
  }
  return "?";
}

std::vector<int64_t> distribute(int64_t total, const std::vector<double>& weights) {
  const double sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  std::vector<int64_t> rows(weights.size());
  int64_t given = 0;
  for (size_t e = 0; e < weights.size(); ++e) given += rows[e] = static_cast<int64_t>(total * weights[e] / sum);
  for (size_t e = 0; given < total; e = (e + 1) % weights.size())
    if (weights[e] > 0) ++rows[e], ++given;
  return rows;
}

std::vector<int64_t> rows_per_expert(const Shape5& s, bool skewed) {
  const int64_t total = s.tokens * s.topk, e = s.experts;
  std::vector<double> w(static_cast<size_t>(e), 1.0);
  if (skewed) {
    // A fixed permutation (multiplication by an odd number mod a power of two, or a stride).
    for (int64_t i = 0; i < e; ++i) {
      const int64_t r = (i * 5 + 3) % e;
      w[static_cast<size_t>(i)] = r == e - 1 ? 0.0 : std::exp(-3.0 * r / std::max<int64_t>(1, e - 1));
    }
  }
  return distribute(total, w);
}

// Every 13th element as doubles (enough to catch a wrong tile, cheap at 10^8+ elements).
std::vector<double> strided_sample(const Tensor& t) {
  const Tensor h = t.to(Device::cpu());
  std::vector<double> v;
  const int64_t n = h.numel();
  for (int64_t i = 0; i < n; i += 13)
    v.push_back(h.dtype() == DType::F32 ? static_cast<double>(h.data<float>()[i])
                                        : static_cast<double>(static_cast<float>(h.data<bf16>()[i])));
  return v;
}

Tensor randn(const Shape& shape, DType t, Device dev, const char* name) {
  Tensor x = Tensor::empty(shape, t, dev);
  ops::fill_normal(x, 1234, rng_key(name), 0.0, 1.0);
  return x;
}

struct Row {
  std::string shape, dist, gemm;
  int64_t m, n, k;  // row-major dense equivalent: [m, k] x [k, n]
  double flops;
  double ms[4];     // grouped, loop, hopper, dense
  double hopper_rel_err = 0;
  bool hopper_ran = true;  // false: the kernel declined the case and "hopper" timed the loop
  double tflops(int i) const { return flops / (ms[i] * 1e-3) / 1e12; }
};

Row run_gemm(const Shape5& s, const std::string& dist, const std::vector<int64_t>& rows, Gemm g, Device dev,
             int repeats) {
  const DType bf = DType::BF16;
  const int64_t m = s.tokens * s.topk, e = s.experts;
  const bool fc1 = g == Gemm::Fc1Fwd || g == Gemm::Fc1Dgrad || g == Gemm::Fc1Wgrad;
  // The layer's weight is [E, wn, wk]: fc1 [E, 2f, h], fc2 [E, h, f].
  const int64_t wn = fc1 ? 2 * s.f : s.h, wk = fc1 ? s.h : s.f;
  Row r{s.name, dist, gemm_name(g), 0, 0, 0, 0, {0, 0, 0, 0}};
  std::function<void()> grouped, dense;
  std::function<bool()> hopper_direct;  // the kernel itself: false where it declines
  Tensor* out = nullptr;  // what `grouped` writes (dw accumulates: zeroed before the check)
  Tensor a, b, c, w, dw;
  if (g == Gemm::Fc1Fwd || g == Gemm::Fc2Fwd) {
    a = randn({m, wk}, bf, dev, "x"), w = randn({e, wn, wk}, bf, dev, "w"), c = Tensor::empty({m, wn}, bf, dev);
    Tensor w0 = w.slice(0, 0, 1).view({wn, wk});
    grouped = [&] { ops::grouped_gemm_forward(a, w, rows, c); };
#if MOECORE_WITH_CUDA
    hopper_direct = [&] { return ops::cuda::hopper_grouped_gemm_forward(a, w, rows, c); };
#endif
    dense = [&, w0] { ops::gemm(a, w0, c, false, true); };
    r.m = m, r.n = wn, r.k = wk;
    out = &c;
  } else if (g == Gemm::Fc1Dgrad || g == Gemm::Fc2Dgrad) {
    a = randn({m, wn}, bf, dev, "dout"), w = randn({e, wn, wk}, bf, dev, "w"), c = Tensor::empty({m, wk}, bf, dev);
    Tensor w0 = w.slice(0, 0, 1).view({wn, wk});
    grouped = [&] { ops::grouped_gemm_dgrad(a, w, rows, c); };
#if MOECORE_WITH_CUDA
    hopper_direct = [&] { return ops::cuda::hopper_grouped_gemm_dgrad(a, w, rows, c); };
#endif
    dense = [&, w0] { ops::gemm(a, w0, c, false, false); };
    r.m = m, r.n = wk, r.k = wn;
    out = &c;
  } else {
    a = randn({m, wn}, bf, dev, "dout"), b = randn({m, wk}, bf, dev, "x");
    dw = Tensor::zeros({e, wn, wk}, DType::F32, dev);
    Tensor dw0 = dw.slice(0, 0, 1).view({wn, wk});
    grouped = [&] { ops::grouped_gemm_wgrad(a, b, rows, dw); };
#if MOECORE_WITH_CUDA
    hopper_direct = [&] { return ops::cuda::hopper_grouped_gemm_wgrad(a, b, rows, dw, true); };
#endif
    dense = [&, dw0]() mutable { ops::gemm(a, b, dw0, true, false, 1.0f, 1.0f); };
    r.m = wn, r.n = wk, r.k = m;
    out = &dw;
  }
  r.flops = 2.0 * static_cast<double>(r.m) * r.n * r.k;
  const int iters = std::max(2, std::min(50, static_cast<int>(2e13 / r.flops)));
  ops::set_grouped_gemm_impl(ops::GroupedGemmImpl::Grouped);
  r.ms[0] = time_ms(dev, iters, repeats, grouped);
  ops::set_grouped_gemm_impl(ops::GroupedGemmImpl::Loop);
  r.ms[1] = time_ms(dev, iters, repeats, grouped);
  ops::set_grouped_gemm_impl(ops::GroupedGemmImpl::Hopper);
  r.ms[2] = time_ms(dev, iters, repeats, grouped);
  r.ms[3] = time_ms(dev, iters, repeats, dense);
  // The Hopper kernel's result against the loop's at this shape.
  std::vector<double> ref, got;
  for (auto impl : {ops::GroupedGemmImpl::Loop, ops::GroupedGemmImpl::Hopper}) {
    ops::set_grouped_gemm_impl(impl);
    if (out == &dw) ops::fill(dw, 0.0);
    grouped();
    (impl == ops::GroupedGemmImpl::Loop ? ref : got) = strided_sample(*out);
  }
  double diff = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) diff = std::max(diff, std::abs(got[i] - ref[i])), scale = std::max(scale, std::abs(ref[i]));
  r.hopper_rel_err = scale > 0 ? diff / scale : diff;
  if (hopper_direct) r.hopper_ran = hopper_direct();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t repeats = 5;
    bool quick = false, presets = false, balanced_only = false;
    std::vector<std::string> only;
    cli::FlagSet flags("bench_grouped_gemm", "Grouped expert GEMMs: cuBLAS grouped, per-expert loop, Hopper kernel, dense.");
    flags.add_int("repeats", &repeats, "timed repetitions (median reported)");
    flags.add_bool("quick", &quick, "only the qwen3 shape, balanced");
    flags.add_bool("presets", &presets, "also the expert shapes of mixtral-small and finegrained-small");
    flags.add_list("shapes", &only, "only these shapes (mixtral, qwen3, mixtral-small, finegrained-small)");
    flags.add_bool("balanced-only", &balanced_only, "only the balanced token counts");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (flags.help_requested()) {
      std::printf("%s", flags.help().c_str());
      return 0;
    }
    if (cuda_device_count() == 0) {
      std::printf("%s\n", nlohmann::json{{"bench", "grouped_gemm"}, {"skipped", "no CUDA device"}}.dump().c_str());
      return 0;
    }
    const Device dev = Device::cuda(0);
    const ops::GroupedGemmImpl default_impl = ops::grouped_gemm_impl();
    const nlohmann::json info = system_info();
    const std::string card = info["cuda_devices"][dev.index]["name"].get<std::string>();
    std::vector<Shape5> shapes = {{"mixtral h4096 f14336 E8 k2 T8192", 4096, 14336, 8, 2, 8192, 85.0},
                                  {"qwen3 h2048 f768 E128 k8 T16384", 2048, 768, 128, 8, 16384, 60.0}};
    std::vector<bool> skews = {false, true};
    if (quick) shapes.erase(shapes.begin()), skews = {false};
    if (presets && !quick) {
      shapes.push_back({"mixtral-small h2048 f5632 E8 k2 T8192", 2048, 5632, 8, 2, 8192, 0.0});
      shapes.push_back({"finegrained-small h1024 f512 E64 k8 T16384", 1024, 512, 64, 8, 16384, 0.0});
    }
    if (!only.empty()) {
      for (const std::string& name : only) {
        const bool known = name == "mixtral" || name == "qwen3" || name == "mixtral-small" || name == "finegrained-small";
        MC_CHECK(known, "bench_grouped_gemm: --shapes: unknown shape '", name,
                 "' (expected mixtral, qwen3, mixtral-small or finegrained-small)");
      }
      std::vector<Shape5> kept;
      for (const Shape5& s : shapes)
        if (std::find(only.begin(), only.end(), s.name.substr(0, s.name.find(' '))) != only.end()) kept.push_back(s);
      MC_CHECK(!kept.empty(), "bench_grouped_gemm: --shapes selects none of the shapes run (the presets' shapes need "
               "--presets)");
      shapes = kept;
    }
    if (balanced_only) skews = {false};
    const std::vector<Gemm> gemms = {Gemm::Fc1Fwd, Gemm::Fc2Fwd, Gemm::Fc1Dgrad, Gemm::Fc1Wgrad, Gemm::Fc2Dgrad, Gemm::Fc2Wgrad};
    std::vector<Row> rows;
    for (const Shape5& s : shapes)
      for (bool skewed : skews) {
        const std::vector<int64_t> groups = rows_per_expert(s, skewed);
        const std::string dist = skewed ? "skewed" : "balanced";
        Row total{s.name, dist, "all six", 0, 0, 0, 0, {0, 0, 0, 0}};
        for (Gemm g : gemms) {
          Row r = run_gemm(s, dist, groups, g, dev, static_cast<int>(repeats));
          total.flops += r.flops;
          for (int i = 0; i < 4; ++i) total.ms[i] += r.ms[i];
          total.hopper_rel_err = std::max(total.hopper_rel_err, r.hopper_rel_err);
          total.hopper_ran = total.hopper_ran && r.hopper_ran;
          rows.push_back(r);
          const nlohmann::json j = {{"bench", "grouped_gemm"}, {"shape", s.name}, {"dist", dist},
                                    {"gemm", r.gemm}, {"device", card}, {"m", r.m}, {"n", r.n}, {"k", r.k},
                                    {"max_rows", *std::max_element(groups.begin(), groups.end())},
                                    {"min_rows", *std::min_element(groups.begin(), groups.end())},
                                    {"grouped_ms", r.ms[0]}, {"loop_ms", r.ms[1]}, {"hopper_ms", r.ms[2]},
                                    {"dense_ms", r.ms[3]}, {"grouped_tflops", r.tflops(0)},
                                    {"loop_tflops", r.tflops(1)}, {"hopper_tflops", r.tflops(2)},
                                    {"dense_tflops", r.tflops(3)}, {"hopper_rel_err", r.hopper_rel_err}, {"hopper_ran", r.hopper_ran}};
          std::printf("%s\n", j.dump().c_str());
          std::fflush(stdout);
        }
        rows.push_back(total);
        const nlohmann::json j = {{"bench", "grouped_gemm"}, {"shape", s.name}, {"dist", dist}, {"gemm", "all six"},
                                  {"device", card}, {"grouped_ms", total.ms[0]}, {"loop_ms", total.ms[1]},
                                  {"hopper_ms", total.ms[2]}, {"dense_ms", total.ms[3]},
                                  {"grouped_pct_of_dense", 100 * total.ms[3] / total.ms[0]},
                                  {"loop_pct_of_dense", 100 * total.ms[3] / total.ms[1]},
                                  {"hopper_pct_of_dense", 100 * total.ms[3] / total.ms[2]},
                                  {"hopper_rel_err", total.hopper_rel_err}, {"hopper_ran", total.hopper_ran},
                                  {"target_pct", s.target_pct}};
        std::printf("%s\n", j.dump().c_str());
        std::fflush(stdout);
      }
    ops::set_grouped_gemm_impl(default_impl);
#if MOECORE_WITH_CUDA
    const bool refused = ops::cuda::grouped_gemm_bf16_f32_refused();
    const size_t lt_version = ops::cuda::cublaslt_version();
#else  // unreachable: no CUDA device was found above
    const bool refused = false;
    const size_t lt_version = 0;
#endif
    std::printf("%s\n", nlohmann::json{{"bench", "grouped_gemm"}, {"bf16_f32_grouped_refused", refused}}.dump().c_str());
    std::printf("\nGrouped GEMM on %s (bf16 in, fp32 accumulate; wgrad into fp32 dw; cuBLASLt %zu)\n", card.c_str(),
                lt_version);
    std::printf("%-34s %-8s %-9s %8s %7s %8s %7s %8s %7s %8s %7s %8s %8s %8s %9s\n", "shape", "dist", "gemm",
                "grp ms", "TF/s", "loop ms", "TF/s", "hop ms", "TF/s", "dense ms", "TF/s", "grp/dns", "loop/dns",
                "hop/dns", "hop err");
    for (const Row& r : rows) {
      char err[32];
      if (r.hopper_ran) std::snprintf(err, sizeof err, "%9.1e", r.hopper_rel_err);
      else std::snprintf(err, sizeof err, "%9s", "declined");  // the "hop" columns are the loop
      std::printf("%-34s %-8s %-9s %8.3f %7.1f %8.3f %7.1f %8.3f %7.1f %8.3f %7.1f %7.1f%% %7.1f%% %7.1f%% %s\n",
                  r.shape.c_str(), r.dist.c_str(), r.gemm.c_str(), r.ms[0], r.tflops(0), r.ms[1], r.tflops(1), r.ms[2],
                  r.tflops(2), r.ms[3], r.tflops(3), 100 * r.ms[3] / r.ms[0], 100 * r.ms[3] / r.ms[1],
                  100 * r.ms[3] / r.ms[2], err);
    }
    std::printf("targets: grouped >= 85%% of dense (mixtral shape), >= 60%% (qwen3 shape); default impl: %s\n",
                ops::grouped_gemm_impl_name(default_impl));
    std::printf("bf16 -> f32 wgrad in cuBLAS's grouped GEMM: %s\n",
                refused ? "refused (grouped wgrad rows ran the per-expert loop)" : "accepted");

    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_grouped_gemm: error: %s\n", e.what());
    return 1;
  }
}
