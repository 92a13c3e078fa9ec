// `moecore convert`: its flags; the conversion is interop::convert (interop/hf_convert.h).
#include <cstdio>

#include "commands.h"
#include "moecore/cli/flags.h"
#include "moecore/interop/hf_convert.h"
#include "train_command.h"

namespace moecore {

int run_convert(const std::vector<std::string>& argv) {
  interop::ConvertOptions o;
  cli::FlagSet flags("moecore convert",
                     "Convert checkpoints between HuggingFace (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) and moecore.");
  flags.add_string("from", &o.from, "source format: hf or moecore");
  flags.add_string("to", &o.to, "target format: moecore or hf");
  flags.add_string("input", &o.input, "source: an HF model directory or a moecore checkpoint directory");
  flags.add_string("output", &o.output, "target directory");
  flags.add_string("max-shard-size", &o.max_shard_size, "largest safetensors shard written for --to hf (e.g. 500MB, 5GB)");
  flags.add_double("progress-interval", &o.progress_interval_s,
                   "seconds between progress lines on stderr (bytes read and written, rate, ETA; 0: none)");
  flags.parse(argv);
  if (flags.help_requested()) {
    std::printf("%s", flags.help().c_str());
    return 0;
  }
  return interop::convert(o, train_flag_codec());
}

}  // namespace moecore
