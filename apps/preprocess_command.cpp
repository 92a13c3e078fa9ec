// `moecore preprocess`: Megatron-LM's tools/preprocess_data.py flags; the conversion is
// moecore::preprocess (data/preprocess.h), with progress on stderr.
#include <iostream>
#include <sstream>

#include "commands.h"
#include "moecore/cli/flags.h"
#include "moecore/data/preprocess.h"
#include "moecore/data/tokenizer.h"

namespace moecore {

int run_preprocess(const std::vector<std::string>& raw_args) {
  // --json-keys takes one or more values (argparse nargs='+'): fold them into one flag value.
  std::vector<std::string> args;
  std::string keys_text;
  bool keys_given = false;
  auto add_key = [&](const std::string& key) {  // appended in two steps (g++ 12 warned on the one-expression form)
    if (!keys_text.empty()) keys_text += ',';
    keys_text += key;
  };
  for (size_t i = 0; i < raw_args.size(); ++i) {
    const std::string& a = raw_args[i];
    if (a == "--json-keys" || a == "--json_keys") {
      keys_given = true;
      while (i + 1 < raw_args.size() && raw_args[i + 1].rfind("--", 0) != 0) {
        add_key(raw_args[++i]);
      }
      if (keys_text.empty()) throw cli::UsageError("moecore preprocess: flag '--json-keys' needs at least one key", __FILE__, __LINE__);
      continue;
    }
    if (a.rfind("--json-keys=", 0) == 0) {
      keys_given = true;
      add_key(a.substr(12));
      continue;
    }
    args.push_back(a);
  }
  PreprocessOptions opt;
  std::string json_keys_dummy;
  cli::FlagSet flags("moecore preprocess",
                     "Tokenise a JSON Lines file into Megatron indexed datasets {prefix}_{key}_document.{bin,idx} "
                     "(Megatron-LM tools/preprocess_data.py).");
  flags.add_string("input", &opt.input, "JSON Lines file, one document per line");
  flags.add_string("json-keys", &json_keys_dummy, "keys to extract, space separated (default: text); one dataset per key");
  flags.add_string("tokenizer-type", &opt.tokenizer_type, kTokenizerTypes);
  flags.add_string("tokenizer-model", &opt.tokenizer_model, "tokenizer.json (or its directory), or a SentencePiece .model");
  flags.add_string("output-prefix", &opt.output_prefix, "output path prefix");
  flags.add_bool("append-eod", &opt.append_eod, "append the end-of-document token to each document");
  flags.add_int("workers", &opt.workers, "tokenizer threads (output is the same for any number)");
  flags.add_bool("skip-bad-lines", &opt.skip_bad_lines, "skip malformed lines (counted) instead of failing");
  flags.parse(args);
  if (flags.help_requested()) {
    std::cout << flags.help();
    return 0;
  }
  if (keys_given) {
    opt.json_keys.clear();
    std::stringstream ss(keys_text);
    for (std::string k; std::getline(ss, k, ',');)
      if (!k.empty()) opt.json_keys.push_back(k);
  }
  for (const char* required : {"input", "output-prefix", "tokenizer-type"})
    if (!flags.given(required))
      throw cli::UsageError(std::string("moecore preprocess: flag '--") + required + "' is required", __FILE__, __LINE__);
  const PreprocessResult r = preprocess(opt, &std::cerr);
  (void)r;
  return 0;
}

}  // namespace moecore
