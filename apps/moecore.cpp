// moecore: one binary, subcommands. This file holds main and the subcommand table; each
// subcommand's flags and entry point are in apps/<name>_command.cpp:
//
//   moecore env           devices, library versions, threads, environment switches (env_command.cpp)
//   moecore train ...     train a MoE model (train_command.cpp lists the flags)
//   moecore eval          a checkpoint's loss on a dataset (eval_command.cpp)
//   moecore generate      sample from a checkpoint (generate_command.cpp)
//   moecore preprocess    JSONL to Megatron .bin/.idx (preprocess_command.cpp)
//   moecore dataset-info  describe a .bin/.idx dataset (dataset_info_command.cpp)
//   moecore convert       HF <-> moecore checkpoints (convert_command.cpp)
//   moecore report        an HTML page of a run's metrics (report_command.cpp)
//   moecore plan          predicted memory and step time of a layout (plan_command.cpp)
//
// Every error ends here: one line "moecore: error: ..." on stderr and exit code 1 (2 for usage
// errors), never an abort.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "commands.h"
#include "moecore/cli/flags.h"
#include "moecore/comm/bootstrap.h"
#include "moecore/core/error.h"
#include "moecore/core/mpi_check.h"
#include "train_command.h"

namespace {

using moecore::cli::FlagSet;
using moecore::cli::UsageError;

struct Subcommand {
  std::string name;
  std::string summary;
  int (*run)(const std::vector<std::string>& args);  // nullptr: not in this version yet
  std::string arrives_with;                          // for subcommands not available yet
};

const std::vector<Subcommand>& subcommands() {
  static const std::vector<Subcommand> list = {
      {"env", "devices, library versions and threads", moecore::run_env, ""},
      {"train", "train a MoE model", moecore::run_train, ""},
      {"eval", "loss and perplexity of a checkpoint on a dataset", moecore::run_eval, ""},
      {"generate", "sample tokens from a checkpoint", moecore::run_generate, ""},
      {"preprocess", "JSONL to Megatron .bin/.idx", moecore::run_preprocess, ""},
      {"dataset-info", "describe a .bin/.idx dataset", moecore::run_dataset_info, ""},
      {"convert", "HF <-> moecore checkpoints (Mixtral, Qwen3-MoE)", moecore::run_convert, ""},
      {"report", "an HTML page of a run's metrics", moecore::run_report, ""},
      {"plan", "predicted memory and step time of a layout; --search for a cluster", moecore::run_plan, ""},
  };
  return list;
}

std::string usage() {
  std::string s =
      "usage: moecore <subcommand> [flags]\n"
      "       moecore --version | --help\n\n"
      "moecore trains Mixture-of-Experts transformers (Megatron-Core MoE semantics) on CPUs and GPUs.\n\n"
      "Subcommands:\n";
  for (const auto& c : subcommands()) {
    std::string left = "  " + c.name;
    left.resize(16, ' ');
    s += left + c.summary + (c.run ? "" : " (not available in this version)") + "\n";
  }
  s += "\n'moecore <subcommand> --help' lists a subcommand's flags.\n";
  return s;
}

int dispatch(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) throw UsageError("moecore: no subcommand given\n" + usage(), __FILE__, __LINE__);
  const std::string name = args[0];
  if (name == "--version" || name == "version") {
    std::cout << "moecore " << MOECORE_VERSION << "\n";
    return 0;
  }
  if (name == "--help" || name == "-h" || name == "help") {
    std::cout << usage();
    return 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  for (const auto& c : subcommands()) {
    if (c.name != name) continue;
    if (c.run) return c.run(rest);
    // Not available yet: still refuse flags by name, then say what is missing.
    FlagSet flags("moecore " + c.name, c.summary);
    flags.parse(rest);
    throw moecore::Error("moecore " + c.name + " is not available in this version (" MOECORE_VERSION
                         "); it arrives with " + c.arrives_with,
                         __FILE__, __LINE__);
  }
  std::vector<std::string> names;
  for (const auto& c : subcommands()) names.push_back(c.name);
  const std::string guess = moecore::cli::closest(name, names);
  throw UsageError("moecore: unknown subcommand '" + name + "'" + (guess.empty() ? "" : "; did you mean '" + guess + "'?") +
                       " (see 'moecore --help')",
                   __FILE__, __LINE__);
}

}  // namespace

namespace {
// Several ranks (mpirun / srun): MPI is initialised for the communicators, and an error on one
// rank aborts them all (MPI_Abort) instead of leaving the others waiting in a collective.
bool g_mpi = false;
// Several ranks under torchrun: no MPI. A failing rank prints its message and exits non-zero;
// torchrun's agent then stops the other ranks (SIGTERM), so none waits forever in a collective.
int g_torchrun_rank = -1;

int fail(int code, const std::string& message, bool usage) {
  std::fprintf(stderr, usage ? "%s\n" : "moecore: error: %s\n", message.c_str());
  if (g_torchrun_rank >= 0) {
    std::fprintf(stderr, "moecore: rank %d failed; torchrun stops the other ranks\n", g_torchrun_rank);
    std::fflush(stderr);
  }
  if (g_mpi) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::fprintf(stderr, "moecore: rank %d failed; stopping every rank\n", rank);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  return code;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    const moecore::comm::LaunchEnv env = moecore::comm::read_launch_env();
    if (env.world > 1 && env.launcher != "torchrun" && env.launcher != "none") {
      moecore::mpi_init(&argc, &argv);
      g_mpi = true;
    }
    if (env.world > 1 && env.launcher == "torchrun") g_torchrun_rank = env.rank;
    const int rc = dispatch(argc, argv);
    if (g_mpi) moecore::mpi_finalize();
    return rc;
  } catch (const UsageError& e) {
    return fail(2, e.what(), true);
  } catch (const moecore::Error& e) {
    return fail(1, e.what(), false);
  } catch (const std::exception& e) {
    return fail(1, std::string("internal error: ") + e.what(), false);
  }
}
