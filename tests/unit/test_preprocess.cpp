// `moecore preprocess`: JSONL -> Megatron indexed datasets read back through IndexedDataset
// and through an independent Python reader (tests/data/read_megatron_dataset.py); worker
// count does not change the bytes; bad lines are named by number or skipped and counted.
// Also the JSONL line reader (CRLF, BOM, blank lines, chunk boundaries).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "moecore/core/error.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/data/jsonl.h"
#include "moecore/data/preprocess.h"
#include "moecore/data/tokenizer.h"

#include "commands.h"  // run_preprocess (apps/)

namespace moecore {
namespace {

namespace fs = std::filesystem;

fs::path data_dir() { return fs::path(__FILE__).parent_path().parent_path() / "data"; }

class PreprocessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("moecore_pre_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }
  PreprocessOptions options(const std::string& input, const std::string& prefix) {
    PreprocessOptions o;
    o.input = input;
    o.output_prefix = (dir_ / prefix).string();
    o.tokenizer_type = "ByteTokenizer";
    o.append_eod = true;
    o.progress_interval_s = 0;
    return o;
  }
  static std::vector<int32_t> document(const IndexedDataset& ds, int64_t i) {
    std::vector<int32_t> out(ds.sequence_length(i));
    ds.read(i, 0, static_cast<int64_t>(out.size()), out.data());
    return out;
  }
  static std::vector<int32_t> bytes_eod(const std::string& s) {
    std::vector<int32_t> v;
    for (unsigned char c : s) v.push_back(c);
    v.push_back(256);
    return v;
  }
  static std::string read_all(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::ostringstream os;
    os << f.rdbuf();
    return os.str();
  }
  template <typename F>
  static std::string error_of(F&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  }
  fs::path dir_;
};

TEST_F(PreprocessTest, DocumentsReadBackAsBytesPlusEod) {
  const std::vector<std::string> texts = {"hello", "h\xC3\xA9llo \xE2\x82\xAC", "tab\tquote\" newline\nend", "x"};
  std::string jsonl;
  for (const auto& t : texts) jsonl += nlohmann::json({{"text", t}, {"id", 1}}).dump() + "\n";
  const PreprocessResult r = preprocess(options(write("in.jsonl", jsonl), "out"), nullptr);
  EXPECT_EQ(r.documents, 4);
  ASSERT_EQ(r.output_prefixes.size(), 1u);
  EXPECT_EQ(r.output_prefixes[0], (dir_ / "out_text_document").string());
  IndexedDataset ds((dir_ / "out_text_document").string());
  EXPECT_EQ(ds.dtype(), TokenDType::U16);  // vocab 257 < 65500
  ASSERT_EQ(ds.num_sequences(), 4);
  EXPECT_EQ(ds.num_documents(), 4);
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(document(ds, i), bytes_eod(texts[i])) << i;
  EXPECT_EQ(r.tokens[0], (5 + 1) + (10 + 1) + (22 + 1) + (1 + 1));  // bytes + eod
}

TEST_F(PreprocessTest, SeveralKeysCrlfBlankLinesNoEod) {
  const std::string in = write("in.jsonl", "\xEF\xBB\xBF{\"text\": \"ab\", \"title\": \"T\"}\r\n\r\n   \n{\"title\": \"U\", \"text\": \"c\"}");
  PreprocessOptions o = options(in, "multi");
  o.json_keys = {"text", "title"};
  o.append_eod = false;
  const PreprocessResult r = preprocess(o, nullptr);
  EXPECT_EQ(r.documents, 2);
  IndexedDataset text((dir_ / "multi_text_document").string()), title((dir_ / "multi_title_document").string());
  ASSERT_EQ(text.num_sequences(), 2);
  EXPECT_EQ(document(text, 0), (std::vector<int32_t>{'a', 'b'}));
  EXPECT_EQ(document(text, 1), (std::vector<int32_t>{'c'}));
  EXPECT_EQ(document(title, 1), (std::vector<int32_t>{'U'}));
}

TEST_F(PreprocessTest, WorkersDoNotChangeTheBytes) {
  std::mt19937 rng(3);
  std::string jsonl;
  for (int i = 0; i < 9000; ++i) {  // several batches of 2048 lines
    std::string t(rng() % 200, ' ');
    for (char& c : t) c = static_cast<char>('a' + rng() % 26);
    jsonl += nlohmann::json({{"text", t}}).dump() + "\n";
  }
  const std::string in = write("in.jsonl", jsonl);
  PreprocessOptions one = options(in, "w1"), two = options(in, "w2");
  two.workers = 2;
  PreprocessOptions four = options(in, "w4");
  four.workers = 4;
  preprocess(one, nullptr);
  preprocess(two, nullptr);
  preprocess(four, nullptr);
  for (const char* ext : {".bin", ".idx"}) {
    const std::string a = read_all(dir_ / (std::string("w1_text_document") + ext));
    EXPECT_GT(a.size(), 1000u);
    EXPECT_EQ(a, read_all(dir_ / (std::string("w2_text_document") + ext))) << ext;
    EXPECT_EQ(a, read_all(dir_ / (std::string("w4_text_document") + ext))) << ext;
  }
}

TEST_F(PreprocessTest, BadLineIsNamedAndNothingIsWritten) {
  const std::string in = write("in.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n\n{\"text\": oops}\n{\"text\": \"c\"}\n");
  PreprocessOptions o = options(in, "bad");
  o.workers = 2;
  const std::string msg = error_of([&] { preprocess(o, nullptr); });
  EXPECT_NE(msg.find(in + ":4: not valid JSON"), std::string::npos) << msg;  // blank line 3 still counts
  EXPECT_NE(msg.find("--skip-bad-lines"), std::string::npos) << msg;
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_EQ(entry.path().filename().string().rfind("bad_", 0), std::string::npos) << entry.path();
}

TEST_F(PreprocessTest, MissingKeyAndNonStringValue) {
  const std::string in1 = write("a.jsonl", "{\"text\": \"a\"}\n{\"txt\": \"b\"}\n");
  EXPECT_NE(error_of([&] { preprocess(options(in1, "a"), nullptr); }).find(":2: missing key 'text'"), std::string::npos);
  const std::string in2 = write("b.jsonl", "{\"text\": 5}\n");
  EXPECT_NE(error_of([&] { preprocess(options(in2, "b"), nullptr); }).find(":1: key 'text' is a number, expected a string"),
            std::string::npos);
  const std::string in3 = write("c.jsonl", "[1, 2]\n");
  EXPECT_NE(error_of([&] { preprocess(options(in3, "c"), nullptr); }).find(":1: not a JSON object"), std::string::npos);
  EXPECT_NE(error_of([&] { preprocess(options((dir_ / "none.jsonl").string(), "d"), nullptr); }).find("cannot open"),
            std::string::npos);
}

TEST_F(PreprocessTest, SkipBadLinesContinuesAndCounts) {
  const std::string in = write("in.jsonl", "{\"text\": \"a\"}\nnot json\n{\"text\": \"b\"}\n{\"other\": 1}\n{\"text\": \"\"}\n{\"text\": \"c\"}");
  PreprocessOptions o = options(in, "skip");
  o.skip_bad_lines = true;
  std::ostringstream log;
  const PreprocessResult r = preprocess(o, &log);
  EXPECT_EQ(r.bad_lines, 2);
  EXPECT_EQ(r.documents, 3);
  EXPECT_EQ(r.empty_documents, 1);
  EXPECT_NE(log.str().find("skipped 2 bad lines"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("line 2: not valid JSON"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("line 4: missing key 'text'"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("preprocess: done: 3 documents"), std::string::npos) << log.str();
  IndexedDataset ds((dir_ / "skip_text_document").string());
  ASSERT_EQ(ds.num_sequences(), 3);
  EXPECT_EQ(document(ds, 2), bytes_eod("c"));
}

TEST_F(PreprocessTest, CommandLineFlags) {
  const std::string in = write("in.jsonl", "{\"text\": \"ab\", \"title\": \"t\"}\n");
  const std::string prefix = (dir_ / "cli").string();
  EXPECT_EQ(run_preprocess({"--input", in, "--json-keys", "text", "title", "--tokenizer-type", "ByteTokenizer",
                            "--output-prefix", prefix, "--append-eod", "--workers", "2"}),
            0);
  EXPECT_TRUE(fs::exists(prefix + "_text_document.bin"));
  EXPECT_TRUE(fs::exists(prefix + "_title_document.idx"));
  EXPECT_NE(error_of([&] { run_preprocess({"--input", in, "--tokenizer-type", "ByteTokenizer"}); })
                .find("'--output-prefix' is required"),
            std::string::npos);
  EXPECT_NE(error_of([&] { run_preprocess({"--input", in, "--output-prefix", prefix, "--tokenizer-type", "Bytes"}); })
                .find("unknown tokenizer type 'Bytes'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { run_preprocess({"--inptu", in}); }).find("--inptu"), std::string::npos);
}

TEST_F(PreprocessTest, IndependentPythonReaderAgrees) {
  if (std::system("python3 -c 'import struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "python3 is not available";
  const std::vector<std::string> texts = {"first", "", "second \xC3\xA9", "3"};
  std::string jsonl;
  for (const auto& t : texts) jsonl += nlohmann::json({{"text", t}}).dump() + "\n";
  preprocess(options(write("in.jsonl", jsonl), "py"), nullptr);
  const std::string out = (dir_ / "py.txt").string();
  const std::string cmd = "python3 " + (data_dir() / "read_megatron_dataset.py").string() + " " +
                          (dir_ / "py_text_document").string() + " > " + out;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::string expect = "dtype uint16 sequences 3 documents 3\n";
  for (const auto& t : texts) {
    if (t.empty()) continue;  // an empty text gives no document
    std::string line;
    for (int32_t v : bytes_eod(t)) line += (line.empty() ? "" : " ") + std::to_string(v);
    expect += line + "\n";
  }
  EXPECT_EQ(read_all(out), expect);
}

TEST_F(PreprocessTest, HuggingFaceTokenizerDataset) {
  if (!tokenizer_has_pcre2()) GTEST_SKIP() << "moecore was built without PCRE2 (libpcre2-dev)";
  const std::string in = write("in.jsonl", "{\"text\": \"hello hello's 12!\"}\n{\"text\": \"abcd\"}\n");
  PreprocessOptions o = options(in, "hf");
  o.tokenizer_type = "HuggingFaceTokenizer";
  o.tokenizer_model = (data_dir() / "tiny_bpe_tokenizer.json").string();
  preprocess(o, nullptr);
  IndexedDataset ds((dir_ / "hf_text_document").string());
  ASSERT_EQ(ds.num_sequences(), 2);
  EXPECT_EQ(document(ds, 0), (std::vector<int32_t>{18, 20, 25, 8, 26, 14, 30}));  // ... + <|endoftext|>
  EXPECT_EQ(document(ds, 1), (std::vector<int32_t>{0, 21, 3, 30}));
}

// ---- the JSONL line reader ----------------------------------------------------------------
TEST(JsonlLineReader, LineNumbersTerminatorsAndBom) {
  auto r = JsonlLineReader::from_buffer("\xEF\xBB\xBF" "a\r\n\n \t\nb\nc");
  std::string line;
  int64_t n = 0;
  std::vector<std::pair<int64_t, std::string>> got;
  while (r.next(line, n)) got.emplace_back(n, line);
  EXPECT_EQ(got, (std::vector<std::pair<int64_t, std::string>>{{1, "a"}, {4, "b"}, {5, "c"}}));
  EXPECT_EQ(r.bytes_read(), 13);  // BOM, CR and LF included
}

TEST(JsonlLineReader, LinesAcrossChunkBoundariesFromAFile) {
  const fs::path p = fs::temp_directory_path() / ("moecore_jsonl_" + std::to_string(::getpid()) + ".jsonl");
  std::vector<std::string> lines;
  std::mt19937 rng(11);
  std::string all;
  for (int i = 0; i < 40; ++i) {
    lines.push_back(std::string(rng() % 600000 + (i == 7 ? 5000000 : 0), static_cast<char>('a' + i % 26)));
    all += lines.back() + "\n";
  }
  std::ofstream(p, std::ios::binary) << all;
  JsonlLineReader r(p.string());
  std::string line;
  int64_t n = 0;
  size_t k = 0;
  while (r.next(line, n)) {
    ASSERT_LT(k, lines.size());
    EXPECT_EQ(n, static_cast<int64_t>(k + 1));
    EXPECT_EQ(line, lines[k]) << k;
    ++k;
  }
  EXPECT_EQ(k, lines.size());
  EXPECT_EQ(r.bytes_read(), static_cast<int64_t>(all.size()));
  JsonlLineReader small(p.string());
  small.set_max_line_bytes(1000);
  EXPECT_THROW(while (small.next(line, n)) {}, Error);
  fs::remove(p);
}

TEST(JsonlFields, Messages) {
  std::vector<std::string> v;
  EXPECT_EQ(parse_jsonl_fields(R"({"text": "a\u00e9", "n": 1})", {"text"}, v), "");
  EXPECT_EQ(v, (std::vector<std::string>{"a\xC3\xA9"}));
  EXPECT_EQ(parse_jsonl_fields(R"({"text": null})", {"text"}, v), "key 'text' is null, expected a string");
  EXPECT_EQ(parse_jsonl_fields(R"("s")", {"text"}, v), "not a JSON object (it is a string)");
  EXPECT_EQ(parse_jsonl_fields(R"({"text": "a"} x)", {"text"}, v).rfind("not valid JSON: parse error", 0), 0u);
}

}  // namespace
}  // namespace moecore
