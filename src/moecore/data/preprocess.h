// `moecore preprocess`: JSON Lines -> Megatron indexed datasets, as Megatron-LM's
// tools/preprocess_data.py without sentence splitting.
//
//   moecore preprocess --input data.jsonl --json-keys text [title ...] --tokenizer-type
//       ByteTokenizer|HuggingFaceTokenizer|SentencePieceTokenizer|Llama2Tokenizer [--tokenizer-model PATH]
//       --output-prefix out/corpus [--append-eod] [--workers N] [--skip-bad-lines]
//
// Output per key: {prefix}_{key}_document.bin/.idx; one JSON line = one document = one
// sequence (its tokens, then eod with --append-eod). Token dtype from the vocabulary size
// (uint16 below 65500, else int32). Lines are tokenised in N worker threads in batches and
// written in input order, so the output does not depend on N. A malformed line (not JSON, not
// an object, a key missing, a value that is not a string) is an Error naming the file and line
// number; with --skip-bad-lines it is skipped, and the count (and the first few) are reported.
// Blank lines are skipped. An empty text gives no sequence (Megatron's preprocess_data.py
// writes none for it either); their count is reported. Progress goes to stderr about once a
// second (documents/s, MB/s), then a summary. The writers use temporary names renamed by
// finalize(), so a failure leaves nothing at the output prefix.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace moecore {

struct PreprocessOptions {
  std::string input;
  std::vector<std::string> json_keys{"text"};
  std::string tokenizer_type, tokenizer_model;
  std::string output_prefix;
  bool append_eod = false;
  int64_t workers = 1;
  bool skip_bad_lines = false;
  double progress_interval_s = 1.0;  // <= 0: no progress lines
};

struct PreprocessResult {
  int64_t documents = 0;      // per key (the same for every key)
  int64_t empty_documents = 0;
  int64_t bad_lines = 0;
  int64_t input_bytes = 0;
  std::vector<int64_t> tokens;            // per key
  std::vector<std::string> output_prefixes;  // per key: {prefix}_{key}_document
  double seconds = 0;
};

// Runs the conversion; progress and summary go to `log` (nullptr: silent). Errors throw.
PreprocessResult preprocess(const PreprocessOptions& options, std::ostream* log);

}  // namespace moecore
