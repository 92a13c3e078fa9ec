#include "moecore/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "moecore/core/error.h"

namespace moecore {

static_assert(std::endian::native == std::endian::little, "the Megatron format is little-endian; so is this reader");

namespace {

constexpr unsigned char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kHeaderBytes = 34;  // magic 9 + version 8 + dtype 1 + counts 16
constexpr uint64_t kVersion = 1;

template <typename T>
T load_le(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::string escaped(const unsigned char* p, size_t n) {
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = p[i];
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '"') {
      s += static_cast<char>(c);
    } else {
      s += "\\x";
      s += hex[c >> 4];
      s += hex[c & 15];
    }
  }
  return s;
}

// Token t as `dtype` into p; false when the dtype cannot hold it exactly.
bool store_token(TokenDType dtype, int64_t t, unsigned char* p) {
  auto put = [&](auto v) { std::memcpy(p, &v, sizeof(v)); };
  auto in = [&](int64_t lo, int64_t hi) { return t >= lo && t <= hi; };
  switch (dtype) {
    case TokenDType::U8: if (!in(0, 255)) return false; put(static_cast<uint8_t>(t)); return true;
    case TokenDType::I8: if (!in(-128, 127)) return false; put(static_cast<int8_t>(t)); return true;
    case TokenDType::I16: if (!in(-32768, 32767)) return false; put(static_cast<int16_t>(t)); return true;
    case TokenDType::U16: if (!in(0, 65535)) return false; put(static_cast<uint16_t>(t)); return true;
    case TokenDType::I32:
      if (!in(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max())) return false;
      put(static_cast<int32_t>(t));
      return true;
    case TokenDType::I64: put(t); return true;
    case TokenDType::F32: if (!in(-(int64_t{1} << 24), int64_t{1} << 24)) return false; put(static_cast<float>(t)); return true;
    case TokenDType::F64: if (!in(-(int64_t{1} << 53), int64_t{1} << 53)) return false; put(static_cast<double>(t)); return true;
  }
  return false;
}

// A stored token as int32; false when it is not an integer in int32 range.
bool load_token(TokenDType dtype, const unsigned char* p, int32_t* out) {
  constexpr int64_t lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
  auto from_double = [&](double v) {
    if (!(v >= static_cast<double>(lo) && v <= static_cast<double>(hi)) || v != std::floor(v)) return false;
    *out = static_cast<int32_t>(v);
    return true;
  };
  switch (dtype) {
    case TokenDType::U8: *out = load_le<uint8_t>(p); return true;
    case TokenDType::I8: *out = load_le<int8_t>(p); return true;
    case TokenDType::I16: *out = load_le<int16_t>(p); return true;
    case TokenDType::U16: *out = load_le<uint16_t>(p); return true;
    case TokenDType::I32: *out = load_le<int32_t>(p); return true;
    case TokenDType::I64: {
      const int64_t v = load_le<int64_t>(p);
      if (v < lo || v > hi) return false;
      *out = static_cast<int32_t>(v);
      return true;
    }
    case TokenDType::F32: return from_double(load_le<float>(p));
    case TokenDType::F64: return from_double(load_le<double>(p));
  }
  return false;
}

}  // namespace

const char* token_dtype_name(TokenDType t) {
  switch (t) {
    case TokenDType::U8: return "uint8";
    case TokenDType::I8: return "int8";
    case TokenDType::I16: return "int16";
    case TokenDType::I32: return "int32";
    case TokenDType::I64: return "int64";
    case TokenDType::F64: return "float64";
    case TokenDType::F32: return "float32";
    case TokenDType::U16: return "uint16";
  }
  return "unknown";
}

int64_t token_dtype_size(TokenDType t) {
  switch (t) {
    case TokenDType::U8: case TokenDType::I8: return 1;
    case TokenDType::I16: case TokenDType::U16: return 2;
    case TokenDType::I32: case TokenDType::F32: return 4;
    case TokenDType::I64: case TokenDType::F64: return 8;
  }
  MC_FAIL("token_dtype_size: unknown dtype code ", static_cast<int>(t));
}

bool token_dtype_valid(uint8_t code) { return code >= 1 && code <= 8; }

TokenDType token_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < 65500 ? TokenDType::U16 : TokenDType::I32;
}

// ---- writer ------------------------------------------------------------------------

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, TokenDType dtype)
    : prefix_(prefix), dtype_(dtype) {
  MC_CHECK(token_dtype_valid(static_cast<uint8_t>(dtype)), "IndexedDatasetWriter(", prefix,
           "): unknown dtype code ", static_cast<int>(dtype), ", expected 1..8");
  const std::string tmp = ".tmp-" + std::to_string(::getpid());
  bin_tmp_ = prefix + ".bin" + tmp;
  idx_tmp_ = prefix + ".idx" + tmp;
  bin_ = std::fopen(bin_tmp_.c_str(), "wb");
  MC_CHECK(bin_ != nullptr, "cannot create ", bin_tmp_, ": ", std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (finalized_) return;
  if (bin_) std::fclose(bin_);
  std::remove(bin_tmp_.c_str());
  std::remove(idx_tmp_.c_str());
}

void IndexedDatasetWriter::add_document(const std::vector<int64_t>& tokens) {
  MC_CHECK(!finalized_, "IndexedDatasetWriter(", prefix_, "): add_document after finalize");
  MC_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), "IndexedDatasetWriter(",
           prefix_, "): document of ", tokens.size(), " tokens; a sequence holds at most 2^31-1 (int32 lengths)");
  const size_t item = static_cast<size_t>(token_dtype_size(dtype_));
  buffer_.resize(tokens.size() * item);
  for (size_t i = 0; i < tokens.size(); ++i)
    MC_CHECK(store_token(dtype_, tokens[i], buffer_.data() + i * item), "IndexedDatasetWriter(", prefix_, "): token ",
             tokens[i], " at position ", i, " of document ", lengths_.size(), " does not fit dtype ",
             token_dtype_name(dtype_));
  if (!buffer_.empty())
    MC_CHECK(std::fwrite(buffer_.data(), 1, buffer_.size(), bin_) == buffer_.size(), "cannot write ", bin_tmp_, ": ",
             std::strerror(errno));
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  num_tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetWriter::finalize() {
  MC_CHECK(!finalized_, "IndexedDatasetWriter(", prefix_, "): finalize called twice");
  const int close_rc = std::fclose(bin_);
  bin_ = nullptr;
  MC_CHECK(close_rc == 0, "cannot write ", bin_tmp_, ": ", std::strerror(errno));

  const uint64_t S = lengths_.size(), D = S + 1;
  std::vector<unsigned char> idx;
  idx.reserve(kHeaderBytes + 12 * S + 8 * D);
  auto append = [&](const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    idx.insert(idx.end(), b, b + n);
  };
  const uint8_t code = static_cast<uint8_t>(dtype_);
  append(kMagic, sizeof(kMagic));
  append(&kVersion, 8);
  append(&code, 1);
  append(&S, 8);
  append(&D, 8);
  append(lengths_.data(), 4 * S);
  const int64_t item = token_dtype_size(dtype_);
  int64_t pointer = 0;
  for (int32_t len : lengths_) {
    append(&pointer, 8);
    pointer += len * item;
  }
  for (int64_t d = 0; d <= static_cast<int64_t>(S); ++d) append(&d, 8);

  std::FILE* f = std::fopen(idx_tmp_.c_str(), "wb");
  MC_CHECK(f != nullptr, "cannot create ", idx_tmp_, ": ", std::strerror(errno));
  const bool wrote = std::fwrite(idx.data(), 1, idx.size(), f) == idx.size();
  const bool closed = std::fclose(f) == 0;
  MC_CHECK(wrote && closed, "cannot write ", idx_tmp_, ": ", std::strerror(errno));
  // .bin first: a reader that finds the new .idx also finds its .bin.
  const std::string bin_path = prefix_ + ".bin", idx_path = prefix_ + ".idx";
  MC_CHECK(std::rename(bin_tmp_.c_str(), bin_path.c_str()) == 0, "cannot rename ", bin_tmp_, " to ", bin_path, ": ",
           std::strerror(errno));
  MC_CHECK(std::rename(idx_tmp_.c_str(), idx_path.c_str()) == 0, "cannot rename ", idx_tmp_, " to ", idx_path, ": ",
           std::strerror(errno));
  finalized_ = true;
}

// ---- reader ------------------------------------------------------------------------

IndexedDataset::Mapping::~Mapping() {
  if (data) ::munmap(const_cast<unsigned char*>(data), size);
}

void IndexedDataset::Mapping::map(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MC_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    MC_FAIL("cannot read ", path, ": ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    MC_FAIL("cannot read ", path, ": not a regular file");
  }
  size = static_cast<size_t>(st.st_size);
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    MC_CHECK(p != MAP_FAILED, "cannot memory-map ", path, ": ", std::strerror(err));
    data = static_cast<const unsigned char*>(p);
  } else {
    ::close(fd);
  }
}

IndexedDataset::IndexedDataset(const std::string& prefix)
    : prefix_(prefix), idx_path_(prefix + ".idx"), bin_path_(prefix + ".bin") {
  idx_.map(idx_path_);
  bin_.map(bin_path_);
  const std::string& I = idx_path_;
  const unsigned char* p = idx_.data;
  const size_t n = idx_.size;

  MC_CHECK(n >= kHeaderBytes, I, ": truncated header: ", n, " bytes, expected at least ", kHeaderBytes,
           " (magic, version, dtype code, sequence and document counts)");
  MC_CHECK(std::memcmp(p, kMagic, sizeof(kMagic)) == 0, I, ": bad magic \"", escaped(p, 9),
           "\", expected \"MMIDIDX\\x00\\x00\" (not a Megatron indexed dataset index)");
  const uint64_t version = load_le<uint64_t>(p + 9);
  MC_CHECK(version == kVersion, I, ": unsupported version ", version, ", expected 1");
  const uint8_t code = p[17];
  MC_CHECK(token_dtype_valid(code), I, ": unknown dtype code ", static_cast<int>(code),
           ", expected 1..8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)");
  dtype_ = static_cast<TokenDType>(code);
  const uint64_t S = load_le<uint64_t>(p + 18), D = load_le<uint64_t>(p + 26);
  // Counts larger than the file cannot be right; the bound also keeps 12*S + 8*D from overflowing.
  const bool counts_fit = S <= n && D <= n;
  const uint64_t expected = counts_fit ? kHeaderBytes + 12 * S + 8 * D : 0;
  MC_CHECK(counts_fit && expected == n, I, ": file size ", n, " bytes does not match its counts (", S,
           " sequences, ", D, " document entries: expected 34 + 12*", S, " + 8*", D,
           (counts_fit ? " = " + std::to_string(expected) + " bytes" : std::string(" bytes, more than the file")),
           (counts_fit && expected > n ? "); the file is truncated" : "); the file is damaged"));
  MC_CHECK(D >= 1, I, ": document count is 0, expected at least 1 (document indices start with 0)");
  num_sequences_ = static_cast<int64_t>(S);
  lengths_off_ = kHeaderBytes;
  pointers_off_ = lengths_off_ + 4 * S;
  const size_t docs_off = pointers_off_ + 8 * S;

  // Lengths >= 0 and pointers = running sum of length * itemsize. The running sum stops growing
  // past the .bin size (checked below), so it cannot overflow.
  const uint64_t item = static_cast<uint64_t>(token_dtype_size(dtype_));
  uint64_t running = 0;
  for (uint64_t i = 0; i < S; ++i) {
    const int32_t len = load_le<int32_t>(p + lengths_off_ + 4 * i);
    MC_CHECK(len >= 0, I, ": sequence ", i, " has negative length ", len);
    const int64_t ptr = load_le<int64_t>(p + pointers_off_ + 8 * i);
    if (ptr < 0 || static_cast<uint64_t>(ptr) != running) {
      const bool beyond = ptr < 0 || static_cast<uint64_t>(ptr) > bin_.size ||
                          static_cast<uint64_t>(len) * item > bin_.size - static_cast<uint64_t>(ptr);
      MC_CHECK(!beyond, I, ": sequence ", i, " (", len, " tokens at byte ", ptr, ") lies beyond the end of ",
               bin_path_, " (", bin_.size, " bytes)");
      MC_FAIL(I, ": sequence pointers and lengths are inconsistent: sequence ", i, " starts at byte ", ptr,
              ", expected ", running, " (the running sum of length * ", item, " bytes)");
    }
    running += static_cast<uint64_t>(len) * item;
    num_tokens_ += len;
    if (running > bin_.size) break;
  }
  MC_CHECK(running == bin_.size, bin_path_, ": ", bin_.size, " bytes, but ", I, " describes ",
           (running > bin_.size ? "more than " : ""), running, " bytes (sum of sequence lengths * ", item, ")",
           (running > bin_.size ? ": the .bin file is truncated" : ": the files do not belong together"));

  document_indices_.resize(D);
  for (uint64_t d = 0; d < D; ++d) {
    const int64_t v = load_le<int64_t>(p + docs_off + 8 * d);
    MC_CHECK(d > 0 || v == 0, I, ": document indices start at ", v, ", expected 0");
    MC_CHECK(d == 0 || v >= document_indices_[d - 1], I, ": document indices decrease at entry ", d, " (",
             document_indices_[d - 1], " then ", v, "), expected non-decreasing");
    MC_CHECK(v <= static_cast<int64_t>(S), I, ": document index entry ", d, " is ", v,
             ", beyond the sequence count ", S);
    document_indices_[d] = v;
  }
  MC_CHECK(document_indices_.back() == static_cast<int64_t>(S), I, ": document indices end at ",
           document_indices_.back(), ", expected the sequence count ", S);
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  MC_CHECK(i >= 0 && i < num_sequences_, prefix_, ": sequence ", i, " out of range [0, ", num_sequences_, ")");
  return load_le<int32_t>(idx_.data + lengths_off_ + 4 * static_cast<size_t>(i));
}

int64_t IndexedDataset::sequence_pointer(int64_t i) const {
  MC_CHECK(i >= 0 && i < num_sequences_, prefix_, ": sequence ", i, " out of range [0, ", num_sequences_, ")");
  return load_le<int64_t>(idx_.data + pointers_off_ + 8 * static_cast<size_t>(i));
}

void IndexedDataset::read(int64_t sequence, int64_t offset, int64_t length, int32_t* out) const {
  const int64_t len = sequence_length(sequence);
  MC_CHECK(offset >= 0 && length >= 0 && offset <= len && length <= len - offset, prefix_, ": read of tokens [",
           offset, ", ", offset, " + ", length, ") of sequence ", sequence, ", which has ", len, " tokens");
  if (length == 0) return;
  const int64_t item = token_dtype_size(dtype_);
  const unsigned char* src = bin_.data + sequence_pointer(sequence) + offset * item;
  for (int64_t i = 0; i < length; ++i)
    if (!load_token(dtype_, src + i * item, out + i)) {
      MC_FAIL(bin_path_, ": token ", offset + i, " of sequence ", sequence, " is not an integer in int32 range (dtype ",
              token_dtype_name(dtype_), ")");
    }
}

}  // namespace moecore
