// The experts' forward GEMM at decoding's row counts (CUDA builds only): a few rows per expert,
// so the GEMM reads each active expert's weight once and does almost no arithmetic; its ceiling is
// the card's copy bandwidth, measured in the same run (bytes read + bytes written per second of a
// 1 GiB device copy, as bench_generate's bound). Each case runs through
//   gemv      the grouped matrix-vector kernel (ops/gemv_cuda.cu; up to kGroupedGemvMaxRows rows)
//   hopper    the Hopper grouped GEMM on each forward tile (grouped_gemm_hopper.h: 128x256,
//             128x128, 64x256, 64x128) and on the tile Auto picks
// and prints GB/s of weight bytes read (the experts with rows) and that as % of the copy rate.
// Shapes: mixtral-small (h2048, f5632, 8 experts, top-2: fc1 [8, 11264, 2048], fc2 [8, 2048,
// 5632]) and finegrained-small (h1024, f512, 64 experts, top-8), at 1, 16 and 64 prompts (one row
// per prompt per routed expert; each prompt's experts drawn distinct with a fixed seed).
// Flags: --repeats N. JSON lines, then a table.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_timing.h"
#include "moecore/cli/flags.h"
#include "moecore/core/device.h"
#include "moecore/core/philox.h"
#include "moecore/core/system_info.h"
#include "moecore/ops/grouped_gemm.h"
#include "moecore/ops/grouped_gemm_hopper.h"
#include "moecore/ops/random.h"

using namespace moecore;
namespace hopper = moecore::ops::cuda::hopper;

namespace {

struct Gemm {
  std::string name;
  int64_t experts, topk, n, k;
};

// Rows per expert when each of `prompts` tokens picks `topk` distinct experts (fixed seed).
std::vector<int32_t> route(int64_t prompts, int64_t topk, int64_t experts) {
  std::mt19937 gen(20261128);
  std::vector<int32_t> counts(static_cast<size_t>(experts), 0), ids(static_cast<size_t>(experts));
  for (int64_t p = 0; p < prompts; ++p) {
    for (int64_t e = 0; e < experts; ++e) ids[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    std::shuffle(ids.begin(), ids.end(), gen);
    for (int64_t j = 0; j < topk; ++j) ++counts[static_cast<size_t>(ids[static_cast<size_t>(j)])];
  }
  return counts;
}

struct Row {
  std::string gemm, kind;
  int64_t prompts, rows;
  double us, gb_s, pct;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    int64_t repeats = 7;
    cli::FlagSet flags("bench_decode_gemm", "The experts' forward GEMM at decoding's row counts, each tile (GPU).");
    flags.add_int("repeats", &repeats, "timed runs per measurement (median)");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (flags.help_requested()) {
      std::printf("%s", flags.help().c_str());
      return 0;
    }
    if (cuda_device_count() == 0) {
      std::printf("bench_decode_gemm: no CUDA device, nothing to measure\n");
      return 0;
    }
    const Device dev = Device::cuda(0);
    const std::string card = system_info()["cuda_devices"][0]["name"].get<std::string>();
    const double copy = bench::copy_bandwidth(dev);
    std::printf("%s\n", nlohmann::json{{"bench", "decode_gemm_copy"}, {"device", card}, {"copy_gb_s", copy / 1e9}}.dump().c_str());
    const std::vector<Gemm> gemms = {{"mixtral-small fc1", 8, 2, 11264, 2048},
                                     {"mixtral-small fc2", 8, 2, 2048, 5632},
                                     {"finegrained-small fc1", 64, 8, 1024, 1024},
                                     {"finegrained-small fc2", 64, 8, 1024, 512}};
    const auto stream = static_cast<cudaStream_t>(current_stream(dev).handle());
    std::vector<Row> table;
    for (const Gemm& g : gemms) {
      Tensor w = Tensor::empty({g.experts, g.n, g.k}, DType::BF16, dev);
      ops::fill_normal(w, 1234, rng_key("bench-w"), 0.0, 0.02);
      for (int64_t prompts : {int64_t{1}, int64_t{16}, int64_t{64}}) {
        const std::vector<int32_t> counts = route(prompts, g.topk, g.experts);
        std::vector<int32_t> off(1, 0);
        int64_t active = 0;
        for (int32_t c : counts) off.push_back(off.back() + c), active += c > 0;
        const int64_t rows = off.back();
        Tensor offsets = Tensor::from_vector(off, {g.experts + 1}, dev);
        Tensor x = Tensor::empty({rows, g.k}, DType::BF16, dev), out = Tensor::empty({rows, g.n}, DType::BF16, dev);
        ops::fill_normal(x, 1234, rng_key("bench-x"), 0.0, 1.0);
        const double bytes = 2.0 * static_cast<double>(active * g.n * g.k);
        auto record = [&](const std::string& kind, double ms) {
          const double gb_s = bytes / (ms * 1e-3) / 1e9;
          table.push_back({g.name, kind, prompts, rows, ms * 1e3, gb_s, 100.0 * gb_s * 1e9 / copy});
          std::printf("%s\n", nlohmann::json{{"bench", "decode_gemm"}, {"device", card}, {"gemm", g.name},
                                             {"kind", kind}, {"prompts", prompts}, {"rows", rows}, {"us", ms * 1e3},
                                             {"weight_gb_s", gb_s}, {"pct_of_copy", table.back().pct}}
                                  .dump()
                                  .c_str());
        };
        const int iters = 50, reps = static_cast<int>(repeats);
        if (rows <= ops::kGroupedGemvMaxRows && ops::cuda::grouped_gemv_takes(x, w, out))
          record("gemv", bench::time_ms(dev, iters, reps, [&] {
                   ops::cuda::grouped_gemv_launch(x, w, offsets.data<int32_t>(), out, stream);
                 }));
        if (!hopper::available(x, w, out, g.experts)) {  // not a Hopper GPU (or not an sm_90a build)
          std::printf("%s\n", nlohmann::json{{"bench", "decode_gemm"}, {"gemm", g.name}, {"prompts", prompts},
                                             {"skipped", "the Hopper kernel does not run here"}}
                                  .dump()
                                  .c_str());
          continue;
        }
        using hopper::ForwardTile;
        for (ForwardTile t : {ForwardTile::Wide128, ForwardTile::Narrow128, ForwardTile::Rows64Wide,
                              ForwardTile::Rows64Narrow, ForwardTile::Auto}) {
          std::string kind = std::string("hopper ") + hopper::forward_tile_name(t);
          if (t == ForwardTile::Auto) {
            int sms = 0;
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
            kind += std::string(" (") + hopper::forward_tile_name(hopper::auto_forward_tile(rows, g.experts, g.n, sms)) + ")";
          }
          record(kind, bench::time_ms(dev, iters, reps, [&] {
                   hopper::grouped_gemm(hopper::GroupedMode::Forward, x, w, out, offsets.data<int32_t>(),
                                        static_cast<int>(g.experts), stream, true, t);
                 }));
        }
      }
    }
    std::printf("\ncopy bandwidth %.0f GB/s (read + write) on %s\n\n", copy / 1e9, card.c_str());
    std::printf("| gemm | prompts | rows | kernel | us | weight GB/s | %% of copy |\n|---|---|---|---|---|---|---|\n");
    for (const Row& r : table)
      std::printf("| %s | %lld | %lld | %s | %.1f | %.0f | %.1f%% |\n", r.gemm.c_str(), static_cast<long long>(r.prompts),
                  static_cast<long long>(r.rows), r.kind.c_str(), r.us, r.gb_s, r.pct);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_decode_gemm: %s\n", e.what());
    return 1;
  }
}
