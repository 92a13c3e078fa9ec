// `moecore report RUN_DIR`: writes RUN_DIR/report.html (or --output FILE) from RUN_DIR/metrics.jsonl,
// a self-contained page of the run's curves and expert loads (report/run_report.h).
#include "commands.h"

#include <iostream>

#include "moecore/cli/flags.h"
#include "moecore/report/run_report.h"

namespace moecore {

int run_report(const std::vector<std::string>& args) {
  std::string output;
  cli::FlagSet flags("moecore report",
                     "moecore report RUN_DIR: one self-contained HTML page (no JavaScript, no network) of a run's "
                     "loss, learning rate, grad norm, throughput, memory and expert loads, from RUN_DIR/metrics.jsonl "
                     "(train with --save RUN_DIR; add --moe-per-layer-logging for the expert-load heatmap).");
  flags.add_string("output", &output, "where to write the page (default: RUN_DIR/report.html)");
  const std::vector<std::string> positional = flags.parse(args, /*allow_positional=*/true);
  if (flags.help_requested()) {
    std::cout << flags.help();
    return 0;
  }
  if (positional.size() != 1)
    throw cli::UsageError("moecore report: expected one run directory (the --save directory of a training run), got " +
                              std::to_string(positional.size()) + " arguments",
                          __FILE__, __LINE__);
  const std::string written = report::write_run_report(positional[0], output);
  std::cout << "moecore report: wrote " << written << "\n";
  return 0;
}

}  // namespace moecore
