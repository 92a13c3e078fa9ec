// FP8 dense GEMM benchmark (GPU): ops::fp8_gemm through cuBLASLt, per-tensor scaling (tensorwise
// and delayed recipes) and 1x128 x 128x128 block scaling (blockwise), beside the bf16 ops::gemm
// on the same shapes: the Mixtral-8x7B expert GEMMs at 8192 tokens, top-2 of 8 experts (2048 rows
// per expert): fc1 forward [2048 x 4096] . [28672 x 4096]^T, fc2 forward [2048 x 14336] .
// [4096 x 14336]^T, fc1 dgrad [2048 x 28672] . [4096 x 28672]^T. Quantisation is not timed (the
// operands are quantised once); bf16 output, fp32 accumulation. Median of --repeats runs (CUDA
// events). One JSON line per measurement, then a table.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_timing.h"
#include "moecore/cli/flags.h"
#include "moecore/core/philox.h"
#include "moecore/core/system_info.h"
#include "moecore/ops/fp8_quant.h"
#include "moecore/ops/gemm.h"
#include "moecore/ops/random.h"

using namespace moecore;

namespace {
struct Case {
  std::string name;
  int64_t m, n, k;
};

struct Row {
  std::string name, kind;
  double ms, tflops;
};
}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t repeats = 5;
    cli::FlagSet flags("bench_fp8_gemm", "FP8 (cuBLASLt) vs bf16 dense GEMM at the Mixtral expert shapes (GPU).");
    flags.add_int("repeats", &repeats, "timed runs per measurement (median)");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (flags.help_requested()) {
      std::printf("%s", flags.help().c_str());
      return 0;
    }
    MC_CHECK(cuda_device_count() > 0, "bench_fp8_gemm needs a CUDA device (the CPU's FP8 GEMM is an emulation)");
    const Device dev = Device::cuda(0);
    const std::string card = system_info()["cuda_devices"][0]["name"].get<std::string>();
    const std::vector<Case> cases = {{"mixtral expert fc1 fwd", 2048, 28672, 4096},
                                     {"mixtral expert fc2 fwd", 2048, 4096, 14336},
                                     {"mixtral expert fc1 dgrad", 2048, 4096, 28672}};
    std::vector<Row> rows;
    for (const Case& c : cases) {
      Tensor a = Tensor::empty({c.m, c.k}, DType::BF16, dev), b = Tensor::empty({c.n, c.k}, DType::BF16, dev);
      ops::fill_normal(a, 1234, rng_key("bench-a"), 0.0, 1.0);
      ops::fill_normal(b, 1234, rng_key("bench-b"), 0.0, 0.02);
      Tensor out = Tensor::empty({c.m, c.n}, DType::BF16, dev);
      const double flops = 2.0 * static_cast<double>(c.m) * c.n * c.k;
      const int iters = std::max(3, static_cast<int>(2e13 / flops));
      auto record = [&](const std::string& kind, double ms) {
        rows.push_back({c.name, kind, ms, flops / (ms * 1e-3) / 1e12});
        const nlohmann::json j = {{"bench", "fp8_gemm"}, {"case", c.name}, {"kind", kind}, {"device", card},
                                  {"m", c.m}, {"n", c.n}, {"k", c.k}, {"ms", ms}, {"tflops", rows.back().tflops}};
        std::printf("%s\n", j.dump().c_str());
      };
      record("bf16", bench::time_ms(dev, iters, static_cast<int>(repeats), [&] { ops::gemm(a, b, out, false, true); }));
      const ops::Fp8Format e4m3 = ops::Fp8Format::E4M3;
      const ops::Fp8Tensor qa = ops::quantize_per_tensor(a, ops::fp8_scale_from_amax(ops::amax(a), e4m3, false), e4m3);
      const ops::Fp8Tensor qb = ops::quantize_per_tensor(b, ops::fp8_scale_from_amax(ops::amax(b), e4m3, false), e4m3);
      record("fp8 per-tensor", bench::time_ms(dev, iters, static_cast<int>(repeats), [&] { ops::fp8_gemm(qa, qb, out); }));
      const ops::Fp8Tensor ta = ops::quantize_tiles(a, e4m3), bb = ops::quantize_blocks(b, e4m3);
      record("fp8 blockwise", bench::time_ms(dev, iters, static_cast<int>(repeats), [&] { ops::fp8_gemm(ta, bb, out); }));
    }
    std::printf("\nFP8 vs bf16 dense GEMM on %s (bf16 out, fp32 accumulate)\n", card.c_str());
    std::printf("%-28s %-16s %9s %9s %9s\n", "case", "kind", "ms", "TFLOP/s", "vs bf16");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const double base = rows[i - i % 3].tflops;
      std::printf("%-28s %-16s %9.3f %9.1f %8.2fx\n", r.name.c_str(), r.kind.c_str(), r.ms, r.tflops, r.tflops / base);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fp8_gemm: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
