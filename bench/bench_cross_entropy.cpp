// Cross-entropy benchmark: the fused output layer's loss step on one chunk of logits (4096 rows
// x 32768 classes in bf16, the benchmark models' chunk), as the two ops (forward, then the
// backward in place) and as the one-pass op (cross_entropy_forward_backward), against the copy
// bandwidth of the same bytes (a device copy reads and writes the logits once: what the one-pass
// op must move at least). Timing: CUDA events around back-to-back calls, median of --repeats.
// Prints one JSON line per measurement and a table.
//
// Flags: --rows N, --classes N, --repeats N.
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
#include "moecore/ops/common.h"
#include "moecore/ops/cross_entropy.h"
#include "moecore/ops/elementwise.h"
#include "moecore/ops/random.h"

using namespace moecore;
using moecore::bench::time_ms;

int main(int argc, char** argv) {
  try {
    int64_t rows = 4096, classes = 32768, repeats = 5;
    cli::FlagSet flags("bench_cross_entropy", "Cross-entropy forward + backward: two ops vs one pass vs copy bandwidth.");
    flags.add_int("rows", &rows, "rows (tokens) of the logits");
    flags.add_int("classes", &classes, "classes (vocabulary) of the logits");
    flags.add_int("repeats", &repeats, "timed repetitions (median reported)");
    flags.parse(std::vector<std::string>(argv + 1, argv + argc));
    if (flags.help_requested()) {
      std::printf("%s", flags.help().c_str());
      return 0;
    }
    MC_CHECK(cuda_device_count() > 0, "bench_cross_entropy needs a GPU: ", cuda_unavailable_reason());
    MC_CHECK(rows > 0 && classes > 0 && repeats > 0, "--rows, --classes and --repeats must be > 0");
    const Device dev = Device::cuda(0);
    const std::string card = system_info()["cuda_devices"][0]["name"].get<std::string>();
    Tensor logits = Tensor::empty({rows, classes}, DType::BF16, dev);
    ops::fill_normal(logits, 7, rng_key("bench-logits"), 0.0, 2.0);
    const Tensor source = logits.clone();  // the copy-bandwidth row copies it
    std::vector<int32_t> t(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % classes);
    const Tensor targets = Tensor::from_vector(t, {rows}).to(dev);
    Tensor loss = Tensor::empty({rows}, DType::F32, dev), lse = Tensor::empty({rows}, DType::F32, dev);
    Tensor dloss = Tensor::empty({rows}, DType::F32, dev);
    ops::fill(dloss, 1.0 / static_cast<double>(rows));
    Tensor copy = Tensor::empty(logits.shape(), DType::BF16, dev);
    const int iters = 20;
    const ops::TargetsValidated checked;  // as in training: no flag read per call
    const double copy_ms = time_ms(dev, iters, static_cast<int>(repeats), [&] { copy.copy_from(source); }, 3);
    const double forward_ms =
        time_ms(dev, iters, static_cast<int>(repeats), [&] { ops::cross_entropy_forward(logits, targets, loss, lse); }, 3);
    // Out of place (separate dlogits): the same traffic as in place, and the input stays intact.
    const double backward_ms = time_ms(dev, iters, static_cast<int>(repeats),
                                       [&] { ops::cross_entropy_backward(logits, targets, lse, dloss, copy); }, 3);
    const double fused_ms = time_ms(dev, iters, static_cast<int>(repeats), [&] {
      ops::cross_entropy_forward_backward(logits, targets, dloss, loss, lse, copy);
    }, 3);
    const double bytes = static_cast<double>(logits.nbytes());
    struct Row {
      const char* name;
      double ms, moved;  // bytes read + written by the op's ideal
    };
    const std::vector<Row> table = {{"device copy (read + write)", copy_ms, 2 * bytes},
                                    {"forward (read)", forward_ms, bytes},
                                    {"backward (read + write)", backward_ms, 2 * bytes},
                                    {"forward + backward, two ops", forward_ms + backward_ms, 3 * bytes},
                                    {"forward_backward, one pass", fused_ms, 2 * bytes}};
    for (const Row& r : table)
      std::printf("%s\n", nlohmann::json({{"bench", "cross_entropy"}, {"case", r.name}, {"rows", rows},
                                          {"classes", classes}, {"ms", r.ms}, {"gb_per_s", r.moved / (r.ms * 1e-3) / 1e9},
                                          {"device", card}})
                              .dump()
                              .c_str());
    std::printf("\ncross-entropy, %lld x %lld bf16 logits (%.0f MiB) on %s\n", static_cast<long long>(rows),
                static_cast<long long>(classes), bytes / 1048576.0, card.c_str());
    std::printf("%-32s %9s %12s %10s\n", "case", "ms", "GB/s moved", "vs copy");
    for (const Row& r : table)
      std::printf("%-32s %9.3f %12.0f %9.2fx\n", r.name, r.ms, r.moved / (r.ms * 1e-3) / 1e9, r.ms / copy_ms);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cross_entropy: %s\n", e.what());
    return 1;
  }
}
