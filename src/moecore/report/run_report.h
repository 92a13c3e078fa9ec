// The run report: one self-contained HTML page (inline SVG, no JavaScript, no network) drawn from
// a run's metrics.jsonl (the lines train/trainer.cpp writes with --save DIR or --metrics-file):
//   - a summary: iterations, final training loss, best validation loss, mean tokens/s, peak memory;
//   - line charts: loss (training and validation), learning rate, grad norm, throughput (tokens/s
//     and TFLOP/s per GPU), memory (allocated and peak), the MoE balancing losses;
//   - with --moe-per-layer-logging: a heatmap of the latest logged step's tokens per expert, each
//     MoE layer divided by its mean (1 = an even share), and each layer's max/mean over time.
// A later line for an iteration already seen (a resumed run appends to the file) replaces it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moecore::report {

struct TrainPoint {
  int64_t iteration = 0;
  // NaN where the line has no such field (or null: a NaN loss is written as null)
  double lm_loss, learning_rate, grad_norm, tokens_per_s, tflops_per_gpu, mem_allocated_bytes,
      mem_max_allocated_bytes, load_balancing_loss, z_loss;
  int64_t skipped_iterations = 0;
  std::vector<std::vector<double>> tokens_per_expert;  // [MoE layers][experts]; empty without per-layer logging
};

struct RunMetrics {
  std::map<int64_t, TrainPoint> train;  // by iteration
  std::map<int64_t, double> valid;      // validation lm loss by iteration
};

// Reads a metrics.jsonl. Errors (moecore::Error) name the file and the line:
// "RUN/metrics.jsonl:7: not JSON (...)", "...:3: \"lm_loss\" is not a number", a file without
// any metrics line, a file that cannot be read.
RunMetrics read_metrics(const std::string& path);

// The HTML page. title: shown at the top (the run directory's path).
std::string render_run_report(const RunMetrics& metrics, const std::string& title);

// Reads RUN_DIR/metrics.jsonl and writes the page to `output` (RUN_DIR/report.html when empty).
// Returns the path written. Errors name the directory or file.
std::string write_run_report(const std::string& run_dir, const std::string& output = "");

}  // namespace moecore::report
