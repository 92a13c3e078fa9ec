// moecore's byte-level BPE against HuggingFace `tokenizers`, token for token.
//
// tests/data/hf/<name>.tokenizer.json were trained by `tokenizers` (tools/make_bpe_fixture.py,
// run on the GPU machine's Python, 2026-11-26) on this repository's README and docs:
//   gpt2_style:   ByteLevel pre-tokenizer with the GPT-2 regex
//   llama3_style: Split on the Llama-3 regex + ByteLevel without regex, ignore_merges
// and <name>.expected.json hold the ids `tokenizers` returned for five test texts (contractions,
// numbers, runs of spaces, tabs and newlines, a special token, accents, CJK, an emoji, code).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "moecore/data/bpe_tokenizer.h"
#include "moecore/data/tokenizer.h"

using namespace moecore;

namespace {
std::filesystem::path hf_dir() { return std::filesystem::path(__FILE__).parent_path().parent_path() / "data" / "hf"; }

void expect_matches_tokenizers(const std::string& name) {
  if (!tokenizer_has_pcre2()) GTEST_SKIP() << "built without PCRE2 (libpcre2-dev): no HuggingFace BPE";
  const BpeTokenizer tok((hf_dir() / (name + ".tokenizer.json")).string());
  std::ifstream f(hf_dir() / (name + ".expected.json"));
  const nlohmann::json cases = nlohmann::json::parse(f);
  ASSERT_EQ(cases.size(), 5u);
  for (const auto& c : cases) {
    const std::string text = c.at("text").get<std::string>();
    const std::vector<int64_t> expected = c.at("ids").get<std::vector<int64_t>>();
    EXPECT_EQ(tok.encode(text), expected) << name << ": " << text;
    EXPECT_EQ(tok.decode(expected), text) << name << ": decode";
  }
}
}  // namespace

TEST(HfTokenizerFixture, Gpt2StyleMatchesTokenizers) { expect_matches_tokenizers("gpt2_style"); }
TEST(HfTokenizerFixture, Llama3StyleMatchesTokenizers) { expect_matches_tokenizers("llama3_style"); }
