// `moecore train`'s flags: registration on a FlagSet, parsing and the checks (train_command.cpp).
// Also the codec the library receives to rebuild TrainArgs from a checkpoint's recorded flags.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moecore/cli/flags.h"
#include "moecore/comm/bootstrap.h"
#include "moecore/train/arguments.h"

namespace moecore {

// Registers every train flag on `flags`, bound to `args` (in the order help and checkpoints list them).
void register_train_flags(cli::FlagSet& flags, TrainArgs& args);
// How a subcommand built on the train flags (moecore eval) uses them.
struct TrainFlagsUse {
  std::string command = "moecore train", summary = "Train a GPT-style MoE model (Megatron-LM flag names).";
  std::function<void(cli::FlagSet&)> extra_flags;             // the subcommand's own flags
  std::vector<std::pair<std::string, std::string>> defaults;  // set before --config and the command line
  std::vector<std::string> also_from_checkpoint;              // flags --load supplies too when not given
  std::function<void(TrainArgs&)> before_finalize;            // after parsing, before the checks
  std::optional<comm::LaunchEnv> launch_env;  // the ranks to check the layout against (moecore plan:
                                              // the planned cluster); unset: the process environment
};
// Parses argv (with --config FILE applied first), fills derived values and validates every
// combination; raises cli::UsageError / Error naming the flag. With --load, the model flags left
// out come from the checkpoint (checkpoint_model_flags in train/arguments.h).
TrainArgs parse_train_args(const std::vector<std::string>& argv, bool* help_requested, std::string* help_text,
                           const TrainFlagsUse& use = {});
// "--data-path p" or "--data-path w1 p1 w2 p2": (weight, prefix) pairs.
std::vector<std::pair<double, std::string>> parse_data_path(const std::vector<std::string>& items);
// Derived values and checks, after parsing; launched: the ranks (null: the process environment).
void finalize_train_args(TrainArgs& args, const comm::LaunchEnv* launched = nullptr);
// Rebuilds the arguments a checkpoint was trained with (its saved flag values), on `device`.
TrainArgs train_args_from_saved(const std::vector<std::pair<std::string, std::string>>& saved,
                                const std::string& device, const std::string& origin);
// Every train flag's value as a checkpoint records it, with `set` applied over the defaults.
std::vector<std::pair<std::string, std::string>> train_flag_values(
    const std::vector<std::pair<std::string, std::string>>& set, const std::string& origin);
// The two above, as the library's TrainFlagCodec.
TrainFlagCodec train_flag_codec();

// The subcommand (args after "train"). Returns the exit status.
int run_train(const std::vector<std::string>& args);

}  // namespace moecore
