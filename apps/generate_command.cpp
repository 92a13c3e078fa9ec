// `moecore generate`: its flags; the sampling itself is moecore::generate (train/generate.h).
#include <cstdio>

#include "commands.h"
#include "moecore/cli/flags.h"
#include "moecore/train/generate.h"
#include "train_command.h"

namespace moecore {

int run_generate(const std::vector<std::string>& argv) {
  GenerateArgs g;
  cli::FlagSet flags("moecore generate", "Sample tokens from a checkpoint written by moecore train --save.");
  flags.add_string("load", &g.load, "checkpoint directory (a --save directory or one iter_* inside it)");
  flags.add_string("prompt", &g.prompt, "prompt text, encoded with the tokenizer the checkpoint was trained with");
  flags.add_string("prompt-ids", &g.prompt_ids, "prompt as space-separated token ids");
  flags.add_string("prompt-file", &g.prompt_file,
                   "JSON Lines file, one {\"prompt\": \"text\"} or {\"prompt_ids\": [ids]} per line: generated as one "
                   "batch, one JSON line per prompt and a summary line with tokens/s");
  flags.add_int("max-new-tokens", &g.max_new_tokens, "tokens to generate");
  flags.add_double("temperature", &g.temperature, "sampling temperature (0: greedy)");
  flags.add_int("top-k", &g.top_k, "sample among the k most likely tokens (0: all)");
  flags.add_double("top-p", &g.top_p, "nucleus sampling: the most likely tokens up to this probability (1: off)");
  flags.add_int("eod-id", &g.eod_id, "a prompt stops after this token (-2: the tokenizer's end of document; -1: never)");
  flags.add_bool("no-kv-cache", &g.no_kv_cache, "re-run the model over the whole sequence for every token (the reference)");
  flags.add_bool("no-cuda-graph", &g.no_cuda_graph,
                 "on a GPU, launch every decoding step's kernels one by one instead of replaying a CUDA graph");
  flags.add_int("seed", &g.seed, "sampling seed");
  flags.add_string("device", &g.device, "cpu, cuda or cuda:N (default: cuda when present)");
  flags.parse(argv);
  if (flags.help_requested()) {
    std::printf("%s", flags.help().c_str());
    return 0;
  }
  return generate(g, train_flag_codec());
}

}  // namespace moecore
