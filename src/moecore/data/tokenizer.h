// Tokenizers for `moecore preprocess` (and later for text in/out of generate), named as
// Megatron's --tokenizer-type:
//   "ByteTokenizer"           ids 0..255 are the UTF-8 bytes of the text, eod = 256, vocab 257.
//                             Any byte string round-trips (invalid UTF-8 included).
//   "HuggingFaceTokenizer"    byte-level BPE from a tokenizer.json (model = the file, or a
//                             directory holding it); see bpe_tokenizer.h. Needs PCRE2 for the
//                             pre-tokenizer regexes.
//   "SentencePieceTokenizer"  a SentencePiece .model file; needs libsentencepiece.
//   "Llama2Tokenizer"         the same with the model's BOS id before every text (Megatron's).
// A tokenizer whose library was not built in raises an Error naming the package to install.
// encode/decode are const and thread-safe (preprocess tokenises in several threads).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moecore {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int64_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t eod() const = 0;  // end-of-document id (an Error if the tokenizer has none)
  virtual std::string name() const = 0;  // the --tokenizer-type
};

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int64_t> encode(std::string_view text) const override;
  // Ids 0..255 become bytes; eod (256) is dropped; anything else is an Error.
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override { return 257; }
  int64_t eod() const override { return 256; }
  std::string name() const override { return "ByteTokenizer"; }
};

// The --tokenizer-type values, for help texts and messages.
inline constexpr const char* kTokenizerTypes =
    "ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer or Llama2Tokenizer";

// type: "ByteTokenizer" (model ignored, may be empty), "HuggingFaceTokenizer",
// "SentencePieceTokenizer", "Llama2Tokenizer". Unknown types are an Error listing the known ones.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& type, const std::string& model);

// Whether the optional libraries were built in (tests skip with the reason when not).
bool tokenizer_has_pcre2();
bool tokenizer_has_sentencepiece();

}  // namespace moecore
