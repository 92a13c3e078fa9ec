// Tokenizers: ByteTokenizer round trips; byte-level BPE on a hand-written tokenizer.json
// (tests/data/tiny_bpe_tokenizer.json) with expected ids worked out by hand from its merges;
// the pre-tokenizer regexes split as their patterns say.
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <thread>
#include <fstream>
#include <random>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "moecore/core/error.h"
#include "moecore/data/bpe_tokenizer.h"
#include "moecore/data/tokenizer.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int64_t>;
using Strs = std::vector<std::string>;

fs::path data_dir() { return fs::path(__FILE__).parent_path().parent_path() / "data"; }

std::string fixture_text() {
  std::ifstream f(data_dir() / "tiny_bpe_tokenizer.json", std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

#define SKIP_WITHOUT_PCRE2() \
  if (!tokenizer_has_pcre2()) GTEST_SKIP() << "moecore was built without PCRE2 (libpcre2-dev): HuggingFaceTokenizer is unavailable"

// The fixture with an edit applied to its JSON.
std::unique_ptr<BpeTokenizer> fixture(const std::function<void(nlohmann::json&)>& edit = nullptr) {
  nlohmann::json j = nlohmann::json::parse(fixture_text());
  if (edit) edit(j);
  return BpeTokenizer::from_json_text(j.dump(), "tiny_bpe_tokenizer.json");
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// ---- ByteTokenizer ---------------------------------------------------------------------
TEST(ByteTokenizer, RoundTripsUtf8AndInvalidBytes) {
  ByteTokenizer t;
  EXPECT_EQ(t.vocab_size(), 257);
  EXPECT_EQ(t.eod(), 256);
  const std::string utf8 = "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80";  // héllo € 😀
  const Ids ids = t.encode(utf8);
  ASSERT_EQ(ids.size(), utf8.size());
  EXPECT_EQ(ids[1], 0xC3);
  EXPECT_EQ(ids[2], 0xA9);
  EXPECT_EQ(t.decode(ids), utf8);
  // Invalid UTF-8: lone continuation, overlong, truncated, NUL and 0xFF.
  const std::string bad("\x80\xC0\xAF\xE2\x82\x00\xFF", 7);
  EXPECT_EQ(t.decode(t.encode(bad)), bad);
  std::mt19937 rng(7);
  std::string random(4096, '\0');
  for (char& c : random) c = static_cast<char>(rng() & 0xFF);
  const Ids r = t.encode(random);
  for (int64_t id : r) ASSERT_TRUE(id >= 0 && id < 256);
  EXPECT_EQ(t.decode(r), random);
  Ids with_eod = t.encode("ab");
  with_eod.push_back(t.eod());
  EXPECT_EQ(t.decode(with_eod), "ab");  // eod decodes to nothing
}

TEST(ByteTokenizer, BadIdsAndTypes) {
  ByteTokenizer t;
  EXPECT_NE(error_of([&] { t.decode({65, 257}); }).find("id 257 at position 1 is not a byte"), std::string::npos);
  EXPECT_THROW(t.decode({-1}), Error);
  EXPECT_NE(error_of([] { make_tokenizer("GPT2Tokenizer", ""); }).find("unknown tokenizer type 'GPT2Tokenizer'"),
            std::string::npos);
  EXPECT_EQ(make_tokenizer("ByteTokenizer", "")->name(), "ByteTokenizer");
}

// ---- regexes ------------------------------------------------------------------------------
TEST(PreTokenizerRegex, Gpt2SplitsContractionsNumbersPunctuationWhitespace) {
  SKIP_WITHOUT_PCRE2();
  EXPECT_EQ(regex_split(kGpt2Pattern, "I'm don't we'll"), (Strs{"I", "'m", " don", "'t", " we", "'ll"}));
  // A run of spaces leaves its last space to the next word (\s+(?!\S)).
  EXPECT_EQ(regex_split(kGpt2Pattern, "abc  123   def"), (Strs{"abc", " ", " 123", "  ", " def"}));
  EXPECT_EQ(regex_split(kGpt2Pattern, "Hello, world!!! 3.14"),
            (Strs{"Hello", ",", " world", "!!!", " 3", ".", "14"}));
  EXPECT_EQ(regex_split(kGpt2Pattern, "a\n\nb  "), (Strs{"a", "\n", "\n", "b", "  "}));
  // Unicode classes (UCP): ï and é are letters, € is neither letter nor number.
  EXPECT_EQ(regex_split(kGpt2Pattern, "na\xC3\xAFve caf\xC3\xA9 42\xE2\x82\xAC"),
            (Strs{"na\xC3\xAFve", " caf\xC3\xA9", " 42", "\xE2\x82\xAC"}));
  // Case-sensitive contractions in GPT-2: "'S" is punctuation + letter.
  EXPECT_EQ(regex_split(kGpt2Pattern, "IT'S"), (Strs{"IT", "'", "S"}));
}

TEST(PreTokenizerRegex, Llama3AndQwenDigitsAndContractions) {
  SKIP_WITHOUT_PCRE2();
  EXPECT_EQ(regex_split(kLlama3Pattern, "12345"), (Strs{"123", "45"}));
  EXPECT_EQ(regex_split(kQwen2Pattern, "12345"), (Strs{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(regex_split(kLlama3Pattern, "IT'S ok"), (Strs{"IT", "'S", " ok"}));  // (?i:...)
  EXPECT_EQ(regex_split(kLlama3Pattern, "hello hello's 12!"), (Strs{"hello", " hello", "'s", " ", "12", "!"}));
  EXPECT_EQ(regex_split(kLlama3Pattern, "x\n\n  y"), (Strs{"x", "\n\n", " ", " y"}));
  EXPECT_EQ(regex_split(kLlama3Pattern, "(hi)"), (Strs{"(hi", ")"}));  // one non-letter joins the word
}

TEST(PreTokenizerRegex, InvalidUtf8FallsIntoGaps) {
  SKIP_WITHOUT_PCRE2();
  const std::string text("ab\xFF\xFE cd", 7);
  const Strs pieces = regex_split(kGpt2Pattern, text);
  std::string joined;
  for (const auto& p : pieces) joined += p;
  EXPECT_EQ(joined, text);  // nothing lost
  EXPECT_EQ(pieces.front(), "ab");
  EXPECT_EQ(pieces.back(), " cd");
}

// ---- BPE ----------------------------------------------------------------------------------
TEST(BpeTokenizer, HandComputedIds) {
  SKIP_WITHOUT_PCRE2();
  auto t = fixture();
  EXPECT_EQ(t->vocab_size(), 32);
  EXPECT_EQ(t->eod(), 30);
  // hello -> h e l l o -> he (rank 0) -> ll (1) -> hell (2) -> hello (3)
  EXPECT_EQ(t->encode("hello"), (Ids{18}));
  // " hello": Ġ h would merge at rank 4, but h e (rank 0) goes first; ... Ġ hello (rank 5).
  // "'s" -> ' s (rank 9); " 12" -> Ġ, 12; "!".
  EXPECT_EQ(t->encode("hello hello's 12!"), (Ids{18, 20, 25, 8, 26, 14}));
  // abcd: pairs a b (7), b c (6), c d (8): b c first, then nothing: a, bc, d (not ab, cd).
  EXPECT_EQ(t->encode("abcd"), (Ids{0, 21, 3}));
  EXPECT_EQ(t->encode("cd"), (Ids{23}));
  // "dd" is in the vocab but no merge makes it.
  EXPECT_EQ(t->encode("dd"), (Ids{3, 3}));
  // é = C3 A9 -> characters Ã © -> merge 11.
  EXPECT_EQ(t->encode("\xC3\xA9"), (Ids{29}));
  EXPECT_EQ(t->encode(""), Ids{});
  EXPECT_EQ(t->token_id("Ġhello"), 20);
  EXPECT_EQ(t->token_id("nope"), -1);
}

TEST(BpeTokenizer, DecodeInvertsEncode) {
  SKIP_WITHOUT_PCRE2();
  auto t = fixture();
  for (const std::string s : {"hello hello's 12!", "abcd dd  cd", "\xC3\xA9 h\xC3\xA9llo", "hello<|endoftext|> <mask>"})
    EXPECT_EQ(t->decode(t->encode(s)), s == "hello<|endoftext|> <mask>" ? "hello<|endoftext|><mask>" : s) << s;
  EXPECT_EQ(t->decode({8, 18}), " hello");
  EXPECT_NE(error_of([&] { t->decode({99}); }).find("id 99 at position 0"), std::string::npos);
}

TEST(BpeTokenizer, MergesAsPairsGiveTheSameIds) {
  SKIP_WITHOUT_PCRE2();
  auto strings = fixture();
  auto pairs = fixture([](nlohmann::json& j) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& m : j["model"]["merges"]) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      list.push_back({s.substr(0, sp), s.substr(sp + 1)});
    }
    j["model"]["merges"] = list;
  });
  for (const std::string s : {"hello hello's 12!", "abcd", "\xC3\xA9", "dd"}) EXPECT_EQ(pairs->encode(s), strings->encode(s)) << s;
  EXPECT_EQ(pairs->encode("abcd"), (Ids{0, 21, 3}));
}

TEST(BpeTokenizer, AddedTokensAreSplitOutFirst) {
  SKIP_WITHOUT_PCRE2();
  auto t = fixture();
  EXPECT_EQ(t->encode("hello<|endoftext|>hello"), (Ids{18, 30, 18}));
  // Inside a word too: the special token is cut out before pre-tokenisation.
  EXPECT_EQ(t->encode("he<|endoftext|>llo"), (Ids{15, 30, 16, 7}));
  // <mask> has lstrip: it swallows the spaces before it.
  EXPECT_EQ(t->encode("hello  <mask>!"), (Ids{18, 31, 14}));
  EXPECT_EQ(t->pretokenize("hello  <mask>!"), (Strs{"hello", "<mask>", "!"}));
  EXPECT_EQ(t->pretokenize("a <|endoftext|> b"), (Strs{"a", " ", "<|endoftext|>", " b"}));
  // A partial special token is plain text.
  EXPECT_EQ(t->pretokenize("<|endoftext"), (Strs{"<|", "endoftext"}));
}

TEST(BpeTokenizer, IgnoreMergesLooksThePreTokenUpFirst) {
  SKIP_WITHOUT_PCRE2();
  auto t = fixture([](nlohmann::json& j) { j["model"]["ignore_merges"] = true; });
  EXPECT_EQ(t->encode("dd"), (Ids{24}));          // whole pre-token in the vocab
  EXPECT_EQ(t->encode("abcd"), (Ids{0, 21, 3}));  // not in the vocab: merges as before
  EXPECT_EQ(t->encode("hello hello"), (Ids{18, 20}));
}

TEST(BpeTokenizer, SplitRegexPreTokenizerAndTemplate) {
  SKIP_WITHOUT_PCRE2();
  auto t = fixture([](nlohmann::json& j) {
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"Regex", kLlama3Pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    j["post_processor"] = nlohmann::json::parse(R"({"type": "Sequence", "processors": [
        {"type": "ByteLevel"},
        {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [], "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [30], "tokens": ["<|endoftext|>"]}}}]})");
  });
  EXPECT_EQ(t->pretokenize("hello hello's 12!"), (Strs{"hello", " hello", "'s", " ", "12", "!"}));
  EXPECT_EQ(t->encode("hello hello's 12!"), (Ids{30, 18, 20, 25, 8, 26, 14}));  // BOS from the template
  auto gpt2 = fixture();
  EXPECT_EQ(gpt2->pretokenize("hello hello's 12!"), (Strs{"hello", " hello", "'s", " 12", "!"}));
}

TEST(BpeTokenizer, NfcNormalizerRefusesWhatItCannotNormalize) {
  SKIP_WITHOUT_PCRE2();
  auto t = fixture([](nlohmann::json& j) { j["normalizer"] = {{"type", "NFC"}}; });
  EXPECT_EQ(t->encode("h\xC3\xA9llo"), (Ids{5, 29, 16, 7}));  // precomposed é is NFC already
  // e + U+0301 (combining acute) would compose to é under NFC: refused, naming the code point.
  const std::string msg = error_of([&] { t->encode("he\xCC\x81llo"); });
  EXPECT_NE(msg.find("U+0301"), std::string::npos) << msg;
  EXPECT_NE(msg.find("NFC"), std::string::npos) << msg;
  // U+2126 OHM SIGN is a singleton that NFC replaces with U+03A9.
  EXPECT_NE(error_of([&] { t->encode("\xE2\x84\xA6"); }).find("U+2126"), std::string::npos);
}

TEST(BpeTokenizer, BadFilesAndBytesAreErrors) {
  SKIP_WITHOUT_PCRE2();
  auto t = fixture();
  EXPECT_NE(error_of([&] { t->encode("z"); }).find("has no token in the vocab"), std::string::npos);
  EXPECT_NE(error_of([] { BpeTokenizer::from_json_text("{", "x.json"); }).find("x.json"), std::string::npos);
  EXPECT_NE(error_of([] {
              fixture([](nlohmann::json& j) { j["model"]["merges"].push_back("h zz"); });
            }).find("'zz' is not in the vocab"),
            std::string::npos);
  EXPECT_NE(error_of([] { fixture([](nlohmann::json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }); })
                .find("pre_tokenizer 'Metaspace' is not supported"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_tokenizer("HuggingFaceTokenizer", "/nonexistent/dir"); }).find("does not exist"),
            std::string::npos);
  // From a directory: tokenizer.json inside it.
  const fs::path dir = fs::temp_directory_path() / ("moecore_tok_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(data_dir() / "tiny_bpe_tokenizer.json", dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  {
    std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": {"content": "<mask>"}})";
  }
  auto from_dir = make_tokenizer("HuggingFaceTokenizer", dir.string());
  EXPECT_EQ(from_dir->encode("hello"), (Ids{18}));
  EXPECT_EQ(from_dir->eod(), 31);  // tokenizer_config.json's eos_token wins
  fs::remove_all(dir);
}

TEST(BpeTokenizer, ThreadsShareTheCache) {
  SKIP_WITHOUT_PCRE2();
  auto t = fixture();
  const Ids expect = t->encode("hello hello's 12! abcd");
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i)
        if (t->encode("hello hello's 12! abcd") != expect) ++mismatches;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(SentencePieceTokenizer, MissingLibraryOrFileIsAnError) {
  const std::string msg = error_of([] { make_tokenizer("SentencePieceTokenizer", "/nonexistent.model"); });
  if (tokenizer_has_sentencepiece()) EXPECT_NE(msg.find("/nonexistent.model"), std::string::npos) << msg;
  else EXPECT_NE(msg.find("libsentencepiece-dev"), std::string::npos) << msg;
}

// tests/data/tiny_sentencepiece.model: trained by SentencePieceTrainer (vocab 50, identity
// normalisation) on 200 lines "hello world this is a tiny sentencepiece corpus number <i>".
TEST(SentencePieceTokenizer, TinyModelRoundTrips) {
  if (!tokenizer_has_sentencepiece()) GTEST_SKIP() << "moecore was built without SentencePiece (libsentencepiece-dev)";
  auto t = make_tokenizer("SentencePieceTokenizer", (data_dir() / "tiny_sentencepiece.model").string());
  EXPECT_EQ(t->vocab_size(), 50);
  EXPECT_EQ(t->eod(), 2);  // </s>
  const Ids ids = t->encode("hello world 42");
  EXPECT_EQ(ids, (Ids{3, 11, 6, 7, 7, 18, 3, 25, 12, 7, 23, 48, 26}));
  EXPECT_EQ(t->decode(ids), "hello world 42");
  EXPECT_THROW(t->decode({50}), Error);
}

// Llama2Tokenizer: the same model, with its BOS id (<s> = 1) before every text, as Megatron's
// Llama2Tokenizer.tokenize (bos=True, eos=False); decoding drops the control piece.
TEST(SentencePieceTokenizer, Llama2TokenizerPutsBosFirst) {
  if (!tokenizer_has_sentencepiece()) GTEST_SKIP() << "moecore was built without SentencePiece (libsentencepiece-dev)";
  const std::string model = (data_dir() / "tiny_sentencepiece.model").string();
  auto plain = make_tokenizer("SentencePieceTokenizer", model);
  auto llama = make_tokenizer("Llama2Tokenizer", model);
  EXPECT_EQ(llama->name(), "Llama2Tokenizer");
  EXPECT_EQ(llama->vocab_size(), plain->vocab_size());
  EXPECT_EQ(llama->eod(), plain->eod());
  Ids want = {1};
  for (int64_t id : plain->encode("hello world 42")) want.push_back(id);
  const Ids ids = llama->encode("hello world 42");
  EXPECT_EQ(ids, want);
  EXPECT_EQ(llama->decode(ids), "hello world 42");
  EXPECT_EQ(llama->encode(""), Ids{1});
  const std::string msg = error_of([] { make_tokenizer("Llama2Tokenizer", ""); });
  EXPECT_EQ(msg, "--tokenizer-type Llama2Tokenizer needs --tokenizer-model (a .model file)");
}

}  // namespace
}  // namespace moecore
