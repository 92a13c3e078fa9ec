// --tokenizer-type HuggingFaceTokenizer: byte-level BPE read from a HuggingFace tokenizer.json
// (GPT-2, Llama-3, Qwen2/3 style).
//
// encode(text):
//   1. normalizer: none, or NFC (Qwen). NFC is only checked, not performed: text whose code
//      points are all NFC-inert (no combining marks, no composable or decomposable characters:
//      ASCII, Latin-1/Extended, Greek, Cyrillic, CJK, kana, Hangul syllables, emoji...) is
//      unchanged by NFC; any other code point raises an Error naming it (no silent mis-encoding).
//   2. added_tokens (special and not) are split out first: leftmost match, longest on ties;
//      lstrip/rstrip swallow neighbouring whitespace; single_word needs non-word neighbours.
//   3. pre_tokenizer on each remaining segment: Split {Regex|String, behavior Isolated|Removed},
//      ByteLevel {add_prefix_space, use_regex -> GPT-2's pattern}, Digits, Sequence of these.
//      Regexes run in PCRE2 (UTF + UCP; invalid UTF-8 bytes never match and fall into gaps).
//   4. each pre-token: bytes -> GPT-2 bytes_to_unicode characters -> initial symbols;
//      with ignore_merges the whole pre-token is looked up first; otherwise repeatedly merge
//      the adjacent pair of lowest merge rank (leftmost on ties; rank = position in
//      model.merges, given as "a b" or [a, b]). Results are cached per pre-token.
//   5. post_processor: TemplateProcessing's "single" template adds its special tokens (Llama-3's
//      BOS) as Megatron's HuggingFaceTokenizer.tokenize (= transformers' __call__) does.
// decode(ids): added tokens give their content; other tokens map characters back to bytes.
// vocab_size = 1 + largest id in vocab and added_tokens. eod = tokenizer_config.json's
// eos_token when that file sits beside tokenizer.json, else the first of <|endoftext|>,
// <|end_of_text|>, </s>, <eos> that exists; without one eod() is an Error.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/data/tokenizer.h"

namespace moecore {

// Pre-tokenizer patterns (docs/formats.md).
extern const char* const kGpt2Pattern;
extern const char* const kLlama3Pattern;
extern const char* const kQwen2Pattern;

// The pieces PCRE2 (UTF, UCP) makes of `text` with `pattern` under HF's "Isolated" behaviour:
// matches and the non-empty gaps between them, in order. Without PCRE2 it is an Error.
std::vector<std::string> regex_split(const std::string& pattern, std::string_view text);

class BpeTokenizer : public Tokenizer {
 public:
  // path: a tokenizer.json, or a directory holding one.
  explicit BpeTokenizer(const std::string& path);
  // From the text of a tokenizer.json (origin names it in errors).
  static std::unique_ptr<BpeTokenizer> from_json_text(std::string_view json, const std::string& origin);
  ~BpeTokenizer() override;

  std::vector<int64_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override;
  int64_t eod() const override;
  std::string name() const override { return "HuggingFaceTokenizer"; }

  // The pre-tokens of `text` (after added-token splitting and the pre_tokenizer; added tokens
  // appear as themselves), as raw bytes.
  std::vector<std::string> pretokenize(std::string_view text) const;
  // Id of a token string as written in tokenizer.json (byte-level characters), or -1.
  int64_t token_id(const std::string& token) const;

  struct Impl;

 private:
  BpeTokenizer();
  std::unique_ptr<Impl> impl_;
};

}  // namespace moecore
