// libFuzzer target: arbitrary bytes as a Megatron indexed dataset. The reader must either
// accept the files and then serve every token of every sequence, or raise moecore::Error;
// anything else (a crash, an ASan/UBSan report, another exception, a hang) is a bug.
//
// Input: byte 0 chooses the layout.
//   even: bytes 1.. are PREFIX.idx; PREFIX.bin is a fixed valid 18-byte uint16 .bin
//         (documents [1 2 3] [4 5] [6 7 8 9]), so mutations of a valid .idx reach deep checks.
//   odd:  bytes 1-2 = n (little-endian u16), the next n bytes are PREFIX.idx, the rest PREFIX.bin.
// With MOECORE_FUZZ_SEED_DIR set (scripts/fuzz.sh sets it to the corpus), LLVMFuzzerInitialize
// writes valid datasets of several dtypes there as seeds.
//
// Built by scripts/fuzz.sh; the lines below name what it compiles and links with this file.
// fuzz-sources: src/moecore/data/indexed_dataset.cpp src/moecore/core/error.cpp
// fuzz-libs:
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/data/indexed_dataset.h"

namespace {

std::string g_prefix;

void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The .bin of the even layout: uint16 tokens 1..9.
const uint8_t kFixedBin[18] = {1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 0, 8, 0, 9, 0};

void write_seeds(const std::string& dir) {
  using moecore::TokenDType;
  const std::string tmp = g_prefix + "_seed";
  int n = 0;
  auto save = [&](const std::vector<uint8_t>& bytes) {
    const std::string path = dir + "/seed-indexed-dataset-" + std::to_string(n++);
    write_file(path, bytes.data(), bytes.size());
  };
  {  // even layout: the .idx that belongs to kFixedBin
    moecore::IndexedDatasetWriter w(tmp, TokenDType::U16);
    w.add_document({1, 2, 3});
    w.add_document({4, 5});
    w.add_document({6, 7, 8, 9});
    w.finalize();
    std::vector<uint8_t> in = {0};
    const auto idx = read_file(tmp + ".idx");
    in.insert(in.end(), idx.begin(), idx.end());
    save(in);
  }
  for (TokenDType t : {TokenDType::U8, TokenDType::I64, TokenDType::F32, TokenDType::F64, TokenDType::I32}) {
    moecore::IndexedDatasetWriter w(tmp, t);
    w.add_document({1, 2, 3});
    w.add_document({});
    w.add_document({100, 7});
    w.finalize();
    const auto idx = read_file(tmp + ".idx"), bin = read_file(tmp + ".bin");
    std::vector<uint8_t> in = {1, static_cast<uint8_t>(idx.size() & 0xff), static_cast<uint8_t>(idx.size() >> 8)};
    in.insert(in.end(), idx.begin(), idx.end());
    in.insert(in.end(), bin.begin(), bin.end());
    save(in);
  }
  std::remove((tmp + ".idx").c_str());
  std::remove((tmp + ".bin").c_str());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  std::string dir = std::string(base) + "/moecore-fuzz-idx-XXXXXX";
  if (!mkdtemp(dir.data())) std::abort();
  g_prefix = dir + "/d";
  static std::string scratch = dir;
  std::atexit([] {
    std::remove((g_prefix + ".idx").c_str());
    std::remove((g_prefix + ".bin").c_str());
    rmdir(scratch.c_str());
  });
  if (const char* seeds = std::getenv("MOECORE_FUZZ_SEED_DIR")) write_seeds(seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string idx = g_prefix + ".idx", bin = g_prefix + ".bin";
  if ((data[0] & 1) == 0) {
    write_file(idx, data + 1, size - 1);
    write_file(bin, kFixedBin, sizeof(kFixedBin));
  } else {
    if (size < 3) return 0;
    size_t n = static_cast<size_t>(data[1]) | (static_cast<size_t>(data[2]) << 8);
    if (n > size - 3) n = size - 3;
    write_file(idx, data + 3, n);
    write_file(bin, data + 3 + n, size - 3 - n);
  }
  try {
    const moecore::IndexedDataset ds(g_prefix);
    std::vector<int32_t> tokens;
    int64_t total = 0;
    for (int64_t s = 0; s < ds.num_sequences(); ++s) {
      const int64_t len = ds.sequence_length(s);
      tokens.assign(static_cast<size_t>(len), 0);
      try {
        ds.read(s, 0, len, tokens.data());
      } catch (const moecore::Error&) {
        // Tokens that are not int32 values (int64/float files): refused, as documented.
      }
      total += len;
    }
    if (total != ds.num_tokens()) std::abort();  // validation promised a consistent dataset
    (void)ds.document_indices();
  } catch (const moecore::Error&) {
    // Damaged input, refused with a message: the expected outcome for most inputs.
  }
  return 0;
}
