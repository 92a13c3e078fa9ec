// AdamW benchmark: the optimizer step's kernels on one flat parameter (default 256M elements,
// about the size of mixtral-small's expert weights), against the copy bandwidth of the device:
//   whole:  f32 master read + written, the bf16 compute weight written (ops::adamw_step with a
//           compute weight), moments f32 or bf16;
//   split:  the master as bf16 high half + int16 remainder, both read + written
//           (ops::adamw_step_split, --store-param-remainders), moments f32 or bf16.
// The gradient (f32) is read in every case. "moved" counts each byte the kernel must read or
// write once: an ideal kernel runs at the copy's GB/s. Timing: CUDA events around back-to-back
// calls, median of --repeats. Prints one JSON line per case and a table.
//
// Flags: --elements N, --repeats N.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_timing.h"
#include "moecore/cli/flags.h"
#include "moecore/core/philox.h"
#include "moecore/core/system_info.h"
#include "moecore/core/tensor.h"
#include "moecore/ops/adamw.h"
#include "moecore/ops/common.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/master_split.h"
#include "moecore/ops/random.h"

using namespace moecore;
using moecore::bench::time_ms;

int main(int argc, char** argv) {
  try {
    int64_t n = int64_t{1} << 28, repeats = 5;
    cli::FlagSet flags("bench_adamw", "AdamW on whole fp32 masters vs split masters, against copy bandwidth.");
    flags.add_int("elements", &n, "parameter elements");
    flags.add_int("repeats", &repeats, "timed repetitions (median reported)");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (flags.help_requested()) {
      std::printf("%s", flags.help().c_str());
      return 0;
    }
    MC_CHECK(cuda_device_count() > 0, "bench_adamw needs a GPU: ", cuda_unavailable_reason());
    MC_CHECK(n > 0 && repeats > 0, "--elements and --repeats must be > 0");
    const Device dev = Device::cuda(0);
    const std::string card = system_info()["cuda_devices"][0]["name"].get<std::string>();
    Tensor master = Tensor::empty({n}, DType::F32, dev), grad = Tensor::empty({n}, DType::F32, dev);
    ops::fill_normal(master, 3, rng_key("bench-master"), 0.0, 0.02);
    ops::fill_normal(grad, 3, rng_key("bench-grad"), 0.0, 1e-3);
    Tensor weight = Tensor::empty({n}, DType::BF16, dev), high = Tensor::empty({n}, DType::BF16, dev);
    Tensor remainder = Tensor::empty({n}, DType::I16, dev);
    ops::split_master(master, high, remainder);
    Tensor copy_dst = Tensor::empty({n}, DType::F32, dev);
    const int iters = 5;
    // A small learning rate keeps the masters where they are over the timed steps.
    const ops::AdamWConfig c{1e-6, 0.9, 0.95, 1e-8, 0.1, 1};
    struct Row {
      std::string name;
      double ms, moved;
    };
    std::vector<Row> table;
    table.push_back({"device copy, f32 (read + write)", time_ms(dev, iters, static_cast<int>(repeats), [&] {
                       copy_dst.copy_from(master);
                     }), 8.0 * static_cast<double>(n)});
    for (DType moments : {DType::F32, DType::BF16}) {
      Tensor m = Tensor::zeros({n}, moments, dev), v = Tensor::zeros({n}, moments, dev);
      const double state = 2.0 * 2.0 * static_cast<double>(dtype_size(moments));  // m and v, read + written
      const std::string tag = std::string(", ") + dtype_name(moments) + " moments";
      table.push_back({"whole f32 master + bf16 weight" + tag, time_ms(dev, iters, static_cast<int>(repeats), [&] {
                         ops::adamw_step(master, grad, m, v, c, 1.0f, &weight);
                       }), (4.0 + 8.0 + 2.0 + state) * static_cast<double>(n)});
      table.push_back({"split master (bf16 + int16)" + tag, time_ms(dev, iters, static_cast<int>(repeats), [&] {
                         ops::adamw_step_split(high, remainder, grad, m, v, c, 1.0f);
                       }), (4.0 + 8.0 + state) * static_cast<double>(n)});
    }
    const double copy_gbs = table[0].moved / (table[0].ms * 1e-3) / 1e9;
    for (const Row& r : table)
      std::printf("%s\n", nlohmann::json({{"bench", "adamw"}, {"case", r.name}, {"elements", n}, {"ms", r.ms},
                                          {"bytes_per_element", r.moved / static_cast<double>(n)},
                                          {"gb_per_s", r.moved / (r.ms * 1e-3) / 1e9}, {"device", card}})
                              .dump()
                              .c_str());
    std::printf("\nAdamW step, %lld elements on %s\n", static_cast<long long>(n), card.c_str());
    std::printf("%-52s %9s %8s %11s %9s\n", "case", "ms", "B/elem", "GB/s moved", "of copy");
    for (const Row& r : table) {
      const double gbs = r.moved / (r.ms * 1e-3) / 1e9;
      std::printf("%-52s %9.3f %8.0f %11.0f %8.0f%%\n", r.name.c_str(), r.ms, r.moved / static_cast<double>(n), gbs,
                  100.0 * gbs / copy_gbs);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_adamw: %s\n", e.what());
    return 1;
  }
}
