#include "moecore/data/sentencepiece_tokenizer.h"

#include "moecore/core/error.h"

#if MOECORE_WITH_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

namespace moecore {

bool tokenizer_has_sentencepiece() { return MOECORE_WITH_SENTENCEPIECE != 0; }

#if MOECORE_WITH_SENTENCEPIECE
namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) {
    const auto status = sp_.Load(path);
    MC_CHECK(status.ok(), "SentencePieceTokenizer: cannot load '", path, "': ", status.ToString());
  }
  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(absl::string_view(text.data(), text.size()), &ids);
    MC_CHECK(status.ok(), "SentencePieceTokenizer::encode: ", status.ToString());
    return std::vector<int64_t>(ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> narrow;
    narrow.reserve(ids.size());
    for (int64_t id : ids) {
      MC_CHECK(id >= 0 && id < vocab_size(), "SentencePieceTokenizer::decode: id ", id, " is outside [0, ",
               vocab_size(), ")");
      narrow.push_back(static_cast<int>(id));
    }
    std::string out;
    const auto status = sp_.Decode(narrow, &out);
    MC_CHECK(status.ok(), "SentencePieceTokenizer::decode: ", status.ToString());
    return out;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int64_t eod() const override {
    MC_CHECK(sp_.eos_id() >= 0, "SentencePieceTokenizer: the model has no end-of-sentence piece (eos_id < 0), so there is no end-of-document id");
    return sp_.eos_id();
  }
  std::string name() const override { return "SentencePieceTokenizer"; }

 private:
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_path) {
  return std::make_unique<SentencePieceTokenizer>(model_path);
}
#else
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_path) {
  MC_FAIL("SentencePieceTokenizer is not available: moecore was built without SentencePiece; install "
          "libsentencepiece-dev (scripts/install-deps.sh) and re-run cmake (model was '", model_path, "')");
}
#endif

}  // namespace moecore
