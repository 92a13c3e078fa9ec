// `moecore report RUN_DIR [--output FILE]` (report_command.cpp): the run's metrics as one HTML page.
#pragma once

#include <string>
#include <vector>

namespace moecore {

// The subcommand (args after "report"). Returns the exit status; errors throw (cli::UsageError for
// usage mistakes, Error for a missing directory or a bad metrics file).
int run_report(const std::vector<std::string>& args);

}  // namespace moecore
