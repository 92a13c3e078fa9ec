// `moecore dataset-info PREFIX`: its flags; the description is moecore::dataset_info (data/dataset_info.h).
#include <iostream>

#include "commands.h"
#include "moecore/cli/flags.h"
#include "moecore/data/dataset_info.h"

namespace moecore {

int run_dataset_info(const std::vector<std::string>& args) {
  cli::FlagSet flags("moecore dataset-info PREFIX",
                     "Describe a Megatron indexed dataset (PREFIX.bin + PREFIX.idx): counts, dtype, "
                     "sequence lengths; the last line is JSON.");
  bool entropy = false;
  flags.add_bool("unigram-entropy", &entropy,
                 "also read every token and report the unigram entropy in nats (a model that beats it has learned "
                 "more than token frequencies)");
  const std::vector<std::string> positional = flags.parse(args, /*allow_positional=*/true);
  if (flags.help_requested()) {
    std::cout << flags.help();
    return 0;
  }
  if (positional.size() != 1)
    throw cli::UsageError("moecore dataset-info: expected one PREFIX (the path of PREFIX.bin/PREFIX.idx without "
                          "the extension), got " + std::to_string(positional.size()) + " arguments",
                          __FILE__, __LINE__);
  return dataset_info(positional[0], entropy);
}

}  // namespace moecore
