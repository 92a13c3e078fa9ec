#include "moecore/data/tokenizer.h"

#include "moecore/core/error.h"
#include "moecore/data/bpe_tokenizer.h"
#include "moecore/data/sentencepiece_tokenizer.h"

namespace moecore {

std::vector<int64_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    if (id == 256) continue;  // eod
    MC_CHECK(id >= 0 && id < 256, "ByteTokenizer::decode: id ", id, " at position ", i,
             " is not a byte (expected 0..255, or 256 = end of document)");
    out.push_back(static_cast<char>(static_cast<unsigned char>(id)));
  }
  return out;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& type, const std::string& model) {
  if (type == "ByteTokenizer") return std::make_unique<ByteTokenizer>();
  if (type == "HuggingFaceTokenizer") {
    MC_CHECK(!model.empty(), "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or its directory)");
    return std::make_unique<BpeTokenizer>(model);
  }
  if (type == "SentencePieceTokenizer" || type == "Llama2Tokenizer") {
    MC_CHECK(!model.empty(), "--tokenizer-type ", type, " needs --tokenizer-model (a .model file)");
    return make_sentencepiece_tokenizer(model, type == "Llama2Tokenizer");
  }
  MC_FAIL("unknown tokenizer type '", type, "'; expected ", kTokenizerTypes);
}

}  // namespace moecore
