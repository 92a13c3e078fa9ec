// Megatron indexed dataset: writer -> reader round trips for every dtype, files from an
// independent Python writer (tests/data/write_megatron_dataset.py) read correctly and equal to
// ours byte for byte, and every kind of damage rejected with an Error naming the file and the
// problem. Also dataset-info's output.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/cli/flags.h"
#include "moecore/core/error.h"
#include "moecore/data/dataset_info.h"
#include "moecore/data/indexed_dataset.h"

#include "commands.h"  // run_dataset_info (apps/)

using namespace moecore;
namespace fs = std::filesystem;

namespace {

class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() / ("moecore-data1-idx-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::vector<unsigned char> slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void spit(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

using Docs = std::vector<std::vector<int64_t>>;

void write_ours(const std::string& prefix, TokenDType dtype, const Docs& docs) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& d : docs) w.add_document(d);
  w.finalize();
}

bool have_python() { return std::system("python3 -c 'import struct' >/dev/null 2>&1") == 0; }

// The independent writer beside this file: tests/data/write_megatron_dataset.py.
void write_python(const ScratchDir& dir, const std::string& prefix, int code, const Docs& docs) {
  const std::string script = (fs::path(__FILE__).parent_path().parent_path() / "data" / "write_megatron_dataset.py").string();
  const std::string input = dir.file("docs.txt");
  {
    std::ofstream f(input);
    for (const auto& d : docs) {
      for (size_t i = 0; i < d.size(); ++i) f << (i ? " " : "") << d[i];
      f << "\n";
    }
  }
  const std::string cmd = "python3 '" + script + "' '" + prefix + "' " + std::to_string(code) + " '" + input + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// Documents that exercise the range of each dtype (including an empty document).
Docs docs_for(TokenDType t) {
  switch (t) {
    case TokenDType::U8: return {{0, 1, 255}, {}, {7, 8, 9, 10}};
    case TokenDType::I8: return {{-128, 0, 127}, {}, {-1, 5}};
    case TokenDType::I16: return {{-32768, 32767}, {}, {1, 2, 3}};
    case TokenDType::U16: return {{0, 65535, 65499}, {}, {42}};
    case TokenDType::I32: return {{INT32_MIN, INT32_MAX, 0}, {}, {100000, 5}};
    case TokenDType::I64: return {{INT32_MIN, INT32_MAX}, {}, {-7, 1}};
    case TokenDType::F32: return {{0, 16777216, -5}, {}, {3, 200000}};
    case TokenDType::F64: return {{0, INT32_MAX, INT32_MIN}, {}, {1}};
  }
  return {};
}

const TokenDType kAll[] = {TokenDType::U8,  TokenDType::I8,  TokenDType::I16, TokenDType::I32,
                           TokenDType::I64, TokenDType::F64, TokenDType::F32, TokenDType::U16};

void expect_contents(const IndexedDataset& ds, const Docs& docs) {
  ASSERT_EQ(ds.num_sequences(), static_cast<int64_t>(docs.size()));
  ASSERT_EQ(ds.num_documents(), static_cast<int64_t>(docs.size()));
  int64_t tokens = 0;
  std::vector<int64_t> starts;
  for (size_t i = 0; i < docs.size(); ++i) {
    starts.push_back(static_cast<int64_t>(i));
    tokens += static_cast<int64_t>(docs[i].size());
    ASSERT_EQ(ds.sequence_length(static_cast<int64_t>(i)), static_cast<int64_t>(docs[i].size()));
    std::vector<int32_t> got(docs[i].size(), -99);
    ds.read(static_cast<int64_t>(i), 0, static_cast<int64_t>(got.size()), got.data());
    for (size_t j = 0; j < got.size(); ++j) EXPECT_EQ(got[j], docs[i][j]) << "sequence " << i << " token " << j;
    if (docs[i].size() >= 2) {  // a read from an offset
      int32_t one = -99;
      ds.read(static_cast<int64_t>(i), 1, 1, &one);
      EXPECT_EQ(one, docs[i][1]);
    }
  }
  starts.push_back(static_cast<int64_t>(docs.size()));
  EXPECT_EQ(ds.num_tokens(), tokens);
  EXPECT_EQ(ds.document_indices(), starts);
}

// Catches the Error of opening `prefix` and checks that it names `file` and says `what`.
void expect_open_error(const std::string& prefix, const std::string& file, const std::string& what) {
  try {
    IndexedDataset ds(prefix);
    ADD_FAILURE() << "opening a damaged dataset succeeded; expected an error saying '" << what << "'";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(file), std::string::npos) << "message does not name " << file << ": " << m;
    EXPECT_NE(m.find(what), std::string::npos) << "message does not say '" << what << "': " << m;
  }
}

}  // namespace

TEST(IndexedDataset, DtypeNamesAndVocabChoice) {
  EXPECT_STREQ(token_dtype_name(TokenDType::U16), "uint16");
  EXPECT_STREQ(token_dtype_name(TokenDType::I32), "int32");
  EXPECT_STREQ(token_dtype_name(TokenDType::F64), "float64");
  EXPECT_EQ(static_cast<int>(TokenDType::U16), 8);
  EXPECT_EQ(static_cast<int>(TokenDType::F32), 7);
  EXPECT_EQ(token_dtype_size(TokenDType::I64), 8);
  EXPECT_EQ(token_dtype_for_vocab(32000), TokenDType::U16);
  EXPECT_EQ(token_dtype_for_vocab(65499), TokenDType::U16);
  EXPECT_EQ(token_dtype_for_vocab(65500), TokenDType::I32);
  EXPECT_EQ(token_dtype_for_vocab(151936), TokenDType::I32);
}

TEST(IndexedDataset, RoundTripEveryDtype) {
  ScratchDir dir;
  for (TokenDType t : kAll) {
    SCOPED_TRACE(token_dtype_name(t));
    const std::string prefix = dir.file(std::string("rt_") + token_dtype_name(t));
    const Docs docs = docs_for(t);
    IndexedDatasetWriter w(prefix, t);
    for (const auto& d : docs) w.add_document(d);
    EXPECT_EQ(w.num_documents(), 3);
    EXPECT_FALSE(fs::exists(prefix + ".idx")) << "the .idx appears only at finalize()";
    w.finalize();
    EXPECT_EQ(w.num_tokens(), static_cast<int64_t>(docs[0].size() + docs[2].size()));
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.dtype(), t);
    expect_contents(ds, docs);
    EXPECT_EQ(ds.bin_bytes(), ds.num_tokens() * token_dtype_size(t));
  }
  // No temporaries left behind.
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().string().find(".tmp-"), std::string::npos) << e.path();
}

TEST(IndexedDataset, EmptyDatasetRoundTrips) {
  ScratchDir dir;
  write_ours(dir.file("empty"), TokenDType::U16, {});
  IndexedDataset ds(dir.file("empty"));
  EXPECT_EQ(ds.num_sequences(), 0);
  EXPECT_EQ(ds.num_documents(), 0);
  EXPECT_EQ(ds.document_indices(), std::vector<int64_t>{0});
}

TEST(IndexedDataset, ReadsPythonWriterFiles) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  ScratchDir dir;
  for (TokenDType t : kAll) {
    SCOPED_TRACE(token_dtype_name(t));
    const std::string prefix = dir.file(std::string("py_") + token_dtype_name(t));
    write_python(dir, prefix, static_cast<int>(t), docs_for(t));
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.dtype(), t);
    expect_contents(ds, docs_for(t));
  }
}

TEST(IndexedDataset, WriterBytesEqualPythonWriter) {
  if (!have_python()) GTEST_SKIP() << "python3 not found: the independent writer cannot run";
  ScratchDir dir;
  for (TokenDType t : kAll) {
    SCOPED_TRACE(token_dtype_name(t));
    const std::string ours = dir.file(std::string("ours_") + token_dtype_name(t));
    const std::string theirs = dir.file(std::string("theirs_") + token_dtype_name(t));
    write_ours(ours, t, docs_for(t));
    write_python(dir, theirs, static_cast<int>(t), docs_for(t));
    EXPECT_EQ(slurp(ours + ".idx"), slurp(theirs + ".idx"));
    EXPECT_EQ(slurp(ours + ".bin"), slurp(theirs + ".bin"));
    EXPECT_FALSE(slurp(ours + ".idx").empty());
  }
}

TEST(IndexedDataset, WriterRejectsTokensTheDtypeCannotHold) {
  ScratchDir dir;
  {
    IndexedDatasetWriter w(dir.file("bad"), TokenDType::U16);
    try {
      w.add_document({1, 65536});
      ADD_FAILURE() << "65536 was accepted as uint16";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("does not fit dtype uint16"), std::string::npos) << e.what();
    }
    EXPECT_THROW(w.add_document({-1}), Error);
  }
  // An unfinalised writer leaves nothing behind.
  EXPECT_TRUE(fs::is_empty(dir.path()));
  IndexedDatasetWriter w8(dir.file("bad8"), TokenDType::I8);
  EXPECT_THROW(w8.add_document({128}), Error);
  IndexedDatasetWriter wf(dir.file("badf"), TokenDType::F32);
  EXPECT_THROW(wf.add_document({(1 << 24) + 1}), Error);
}

TEST(IndexedDataset, ReadChecksRangesAndValues) {
  ScratchDir dir;
  write_ours(dir.file("a"), TokenDType::I64, {{1, 2, 3}, {int64_t{1} << 40}});
  IndexedDataset ds(dir.file("a"));
  int32_t out[4];
  EXPECT_THROW(ds.read(0, 2, 2, out), Error);   // past the end of the sequence
  EXPECT_THROW(ds.read(0, -1, 1, out), Error);  // negative offset
  EXPECT_THROW(ds.read(2, 0, 1, out), Error);   // no such sequence
  try {
    ds.read(1, 0, 1, out);
    ADD_FAILURE() << "2^40 was converted to int32";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not an integer in int32 range"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir.file("a.bin")), std::string::npos) << e.what();
  }
  // float files holding a non-integer.
  write_ours(dir.file("f"), TokenDType::F64, {{1, 2}});
  std::vector<unsigned char> bin = slurp(dir.file("f.bin"));
  const double half = 2.5;
  std::memcpy(bin.data() + 8, &half, 8);
  spit(dir.file("f.bin"), bin);
  IndexedDataset f(dir.file("f"));
  f.read(0, 0, 1, out);
  EXPECT_EQ(out[0], 1);
  EXPECT_THROW(f.read(0, 1, 1, out), Error);
}

// ---- damage --------------------------------------------------------------------------
// A valid uint16 dataset of 3 documents [1 2 3] [4 5] [6 7 8 9]: .idx = 34 header bytes,
// lengths at 34, pointers at 46, document indices at 70, 102 bytes in all; .bin 18 bytes.
class IndexedDatasetDamage : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix = dir.file("d");
    write_ours(prefix, TokenDType::U16, {{1, 2, 3}, {4, 5}, {6, 7, 8, 9}});
    idx = slurp(prefix + ".idx");
    bin = slurp(prefix + ".bin");
    ASSERT_EQ(idx.size(), 102u);
    ASSERT_EQ(bin.size(), 18u);
    IndexedDataset ok(prefix);  // valid before damage
  }
  template <typename T>
  void patch(size_t offset, T value) {
    std::memcpy(idx.data() + offset, &value, sizeof(T));
    spit(prefix + ".idx", idx);
  }
  std::string idx_path() const { return prefix + ".idx"; }
  std::string bin_path() const { return prefix + ".bin"; }

  ScratchDir dir;
  std::string prefix;
  std::vector<unsigned char> idx, bin;
};

TEST_F(IndexedDatasetDamage, BadMagic) {
  patch<char>(0, 'X');
  expect_open_error(prefix, idx_path(), "bad magic");
}

TEST_F(IndexedDatasetDamage, BadVersion) {
  patch<uint64_t>(9, 2);
  expect_open_error(prefix, idx_path(), "unsupported version 2, expected 1");
}

TEST_F(IndexedDatasetDamage, UnknownDtypeCode) {
  patch<uint8_t>(17, 9);
  expect_open_error(prefix, idx_path(), "unknown dtype code 9");
  patch<uint8_t>(17, 0);
  expect_open_error(prefix, idx_path(), "unknown dtype code 0");
}

TEST_F(IndexedDatasetDamage, TruncatedIdx) {
  idx.resize(90);
  spit(idx_path(), idx);
  expect_open_error(prefix, idx_path(), "the file is truncated");
  idx.resize(20);
  spit(idx_path(), idx);
  expect_open_error(prefix, idx_path(), "truncated header");
  idx.clear();
  spit(idx_path(), idx);
  expect_open_error(prefix, idx_path(), "truncated header: 0 bytes");
}

TEST_F(IndexedDatasetDamage, CountsLargerThanFile) {
  patch<uint64_t>(18, uint64_t{1} << 62);
  expect_open_error(prefix, idx_path(), "does not match its counts");
  patch<uint64_t>(18, 3);
  patch<uint64_t>(26, 5);
  expect_open_error(prefix, idx_path(), "does not match its counts");
}

TEST_F(IndexedDatasetDamage, TruncatedBin) {
  bin.resize(17);
  spit(bin_path(), bin);
  expect_open_error(prefix, bin_path(), "the .bin file is truncated");
}

TEST_F(IndexedDatasetDamage, BinTooLong) {
  bin.push_back(0);
  spit(bin_path(), bin);
  expect_open_error(prefix, bin_path(), "describes 18 bytes");
}

TEST_F(IndexedDatasetDamage, PointerBeyondBin) {
  patch<int64_t>(46 + 8, 1000);
  expect_open_error(prefix, idx_path(), "lies beyond the end of " + bin_path());
  patch<int64_t>(46 + 8, -2);
  expect_open_error(prefix, idx_path(), "lies beyond the end");
}

TEST_F(IndexedDatasetDamage, SizesAndPointersInconsistent) {
  patch<int64_t>(46 + 8, 4);  // sequence 1 starts at byte 4, but sequence 0 holds 3 uint16
  expect_open_error(prefix, idx_path(), "sequence pointers and lengths are inconsistent: sequence 1 starts at byte 4, expected 6");
  patch<int64_t>(46 + 8, 6);
  patch<int32_t>(34, 2);  // length of sequence 0 changed instead
  expect_open_error(prefix, idx_path(), "inconsistent");
}

TEST_F(IndexedDatasetDamage, NegativeLength) {
  patch<int32_t>(34 + 8, -1);
  expect_open_error(prefix, idx_path(), "sequence 2 has negative length -1");
}

TEST_F(IndexedDatasetDamage, DocumentIndicesNotEndingAtS) {
  patch<int64_t>(70 + 24, 2);
  expect_open_error(prefix, idx_path(), "document indices end at 2, expected the sequence count 3");
}

TEST_F(IndexedDatasetDamage, DocumentIndicesNotStartingAtZero) {
  patch<int64_t>(70, 1);
  expect_open_error(prefix, idx_path(), "document indices start at 1, expected 0");
}

TEST_F(IndexedDatasetDamage, DocumentIndicesDecreasing) {
  patch<int64_t>(70 + 8, 2);
  patch<int64_t>(70 + 16, 1);
  expect_open_error(prefix, idx_path(), "document indices decrease at entry 2");
  patch<int64_t>(70 + 16, 7);
  expect_open_error(prefix, idx_path(), "beyond the sequence count 3");
}

TEST_F(IndexedDatasetDamage, MissingFiles) {
  fs::remove(bin_path());
  expect_open_error(prefix, bin_path(), "cannot open");
  fs::remove(idx_path());
  expect_open_error(prefix, idx_path(), "cannot open");
  fs::create_directories(dir.file("dir.idx"));
  expect_open_error(dir.file("dir"), dir.file("dir.idx"), "not a regular file");
}

// ---- dataset-info ----------------------------------------------------------------------

TEST(DatasetInfo, PrintsTextThenOneJsonLine) {
  ScratchDir dir;
  write_ours(dir.file("info"), TokenDType::U16, {{1, 2, 3}, {4}, {5, 6, 7, 8, 9, 10}, {}});
  testing::internal::CaptureStdout();
  int rc = -1;
  try {
    rc = run_dataset_info({dir.file("info")});
  } catch (...) {
    testing::internal::GetCapturedStdout();
    throw;
  }
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(rc, 0);
  ASSERT_FALSE(out.empty());
  ASSERT_EQ(out.back(), '\n');
  const std::string body = out.substr(0, out.size() - 1);
  const size_t cut = body.rfind('\n');
  ASSERT_NE(cut, std::string::npos) << "expected text lines before the JSON line:\n" << out;
  EXPECT_NE(body.find("uint16"), std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(body.substr(cut + 1));
  EXPECT_EQ(j["sequences"], 4);
  EXPECT_EQ(j["documents"], 4);
  EXPECT_EQ(j["tokens"], 10);
  EXPECT_EQ(j["dtype"], "uint16");
  EXPECT_EQ(j["min_sequence_length"], 0);
  EXPECT_EQ(j["max_sequence_length"], 6);
  EXPECT_DOUBLE_EQ(j["mean_sequence_length"].get<double>(), 2.5);
  EXPECT_EQ(j["empty_sequences"], 1);
  EXPECT_EQ(j["bin_bytes"], 20);
}

TEST(DatasetInfo, AcceptsFileNameAndReportsProblems) {
  ScratchDir dir;
  write_ours(dir.file("x"), TokenDType::I32, {{1, 2}});
  testing::internal::CaptureStdout();
  const int rc = run_dataset_info({dir.file("x.idx")});
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(rc, 0);
  EXPECT_NE(out.find("\"dtype\":\"int32\""), std::string::npos) << out;
  EXPECT_THROW(run_dataset_info({}), cli::UsageError);
  EXPECT_THROW(run_dataset_info({"a", "b"}), cli::UsageError);
  EXPECT_THROW(run_dataset_info({dir.file("x"), "--no-such-flag"}), cli::UsageError);
  try {
    run_dataset_info({dir.file("missing")});
    ADD_FAILURE() << "a missing dataset was described";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("missing.idx")), std::string::npos) << e.what();
  }
}
