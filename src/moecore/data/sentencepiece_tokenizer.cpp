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
  SentencePieceTokenizer(const std::string& path, bool llama2) : llama2_(llama2) {
    const auto status = sp_.Load(path);
    MC_CHECK(status.ok(), name(), ": cannot load '", path, "': ", status.ToString());
    MC_CHECK(!llama2_ || sp_.bos_id() >= 0, "Llama2Tokenizer: the model '", path,
             "' has no beginning-of-sentence piece (bos_id < 0), which Llama2Tokenizer puts before every text");
  }
  std::vector<int64_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(absl::string_view(text.data(), text.size()), &ids);
    MC_CHECK(status.ok(), name(), "::encode: ", status.ToString());
    std::vector<int64_t> out;
    out.reserve(ids.size() + 1);
    if (llama2_) out.push_back(sp_.bos_id());  // Megatron's Llama2Tokenizer.tokenize(s, bos=True, eos=False)
    out.insert(out.end(), ids.begin(), ids.end());
    return out;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> narrow;
    narrow.reserve(ids.size());
    for (int64_t id : ids) {
      MC_CHECK(id >= 0 && id < vocab_size(), name(), "::decode: id ", id, " is outside [0, ",
               vocab_size(), ")");
      narrow.push_back(static_cast<int>(id));
    }
    std::string out;
    const auto status = sp_.Decode(narrow, &out);
    MC_CHECK(status.ok(), name(), "::decode: ", status.ToString());
    return out;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int64_t eod() const override {
    MC_CHECK(sp_.eos_id() >= 0, name(), ": the model has no end-of-sentence piece (eos_id < 0), so there is no end-of-document id");
    return sp_.eos_id();
  }
  std::string name() const override { return llama2_ ? "Llama2Tokenizer" : "SentencePieceTokenizer"; }

 private:
  bool llama2_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_path, bool llama2) {
  return std::make_unique<SentencePieceTokenizer>(model_path, llama2);
}
#else
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_path, bool llama2) {
  MC_FAIL(llama2 ? "Llama2Tokenizer" : "SentencePieceTokenizer", " is not available: moecore was built without "
          "SentencePiece; install libsentencepiece-dev (scripts/install-deps.sh) and re-run cmake (model was '",
          model_path, "')");
}
#endif

}  // namespace moecore
