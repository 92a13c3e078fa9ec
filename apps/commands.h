// The subcommands of the moecore binary: each parses its own flags (cli::FlagSet) and calls the
// library with an options struct. Each returns the exit status; errors throw (cli::UsageError for
// usage mistakes, Error for everything else) and apps/moecore.cpp turns them into one message.
// `moecore train` is in train_command.h.
#pragma once

#include <string>
#include <vector>

namespace moecore {

int run_env(const std::vector<std::string>& args);           // env_command.cpp
int run_generate(const std::vector<std::string>& args);      // generate_command.cpp
int run_preprocess(const std::vector<std::string>& args);    // preprocess_command.cpp
int run_dataset_info(const std::vector<std::string>& args);  // dataset_info_command.cpp
int run_convert(const std::vector<std::string>& args);       // convert_command.cpp
int run_report(const std::vector<std::string>& args);        // report_command.cpp
int run_eval(const std::vector<std::string>& args);          // eval_command.cpp
int run_plan(const std::vector<std::string>& args);          // plan_command.cpp

}  // namespace moecore
