// Megatron-LM indexed dataset (prefix.bin + prefix.idx), read and written byte for byte as
// megatron/core/datasets/indexed_dataset.py does (layout: docs/formats.md).
//
// .idx, little-endian, no padding:
//   off 0   9 bytes  magic "MMIDIDX\x00\x00"
//   off 9   u64      version = 1
//   off 17  u8       dtype code (TokenDType below)
//   off 18  u64      sequence_count S
//   off 26  u64      document_count D (= number of documents + 1)
//   off 34  int32[S] sequence lengths in tokens     (unaligned: read with memcpy)
//           int64[S] sequence byte offsets into .bin (running sum of length * itemsize, from 0)
//           int64[D] document indices (sequence where each document starts; first 0, last S)
// .bin: the tokens of all sequences back to back, no header; file size = sum(length) * itemsize.
//
// IndexedDataset memory-maps both files and validates everything on open (magic, version,
// dtype, counts against the file size, lengths >= 0, pointers = running sum and within .bin,
// document indices non-decreasing from 0 to S, .bin size = sum): each problem is one Error
// naming the file and what was wrong/expected; damaged input never crashes the reader.
// read() copies [offset, offset + length) of one sequence out of the mapping, converted to
// int32 (values that are not integers in int32 range are an Error).
//
// IndexedDatasetWriter writes prefix.bin / prefix.idx under temporary names (".tmp-<pid>"
// appended) and renames them into place in finalize(); a writer destroyed unfinalised removes
// its temporaries. One add_document() call = one sequence = one document (Megatron's
// preprocess_data.py without sentence splitting).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace moecore {

enum class TokenDType : uint8_t { U8 = 1, I8 = 2, I16 = 3, I32 = 4, I64 = 5, F64 = 6, F32 = 7, U16 = 8 };  // Megatron codes

// numpy's name: "uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16".
const char* token_dtype_name(TokenDType t);
// Bytes per token.
int64_t token_dtype_size(TokenDType t);
// True for the 8 codes above.
bool token_dtype_valid(uint8_t code);
// Megatron's choice: uint16 when vocab_size < 65500, else int32.
TokenDType token_dtype_for_vocab(int64_t vocab_size);

class IndexedDatasetWriter {
 public:
  // Writes prefix.bin and prefix.idx under temporary names; finalize() renames them into place.
  IndexedDatasetWriter(const std::string& prefix, TokenDType dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // One sequence = one document. Tokens that the dtype cannot hold exactly are an Error.
  void add_document(const std::vector<int64_t>& tokens);
  void finalize();
  int64_t num_documents() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  std::string prefix_, bin_tmp_, idx_tmp_;
  TokenDType dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  int64_t num_tokens_ = 0;
  bool finalized_ = false;
  std::vector<unsigned char> buffer_;
};

class IndexedDataset {  // memory-mapped; every inconsistency is an Error naming the file and what is wrong
 public:
  explicit IndexedDataset(const std::string& prefix);
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }  // document_count - 1
  TokenDType dtype() const { return dtype_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t sequence_length(int64_t i) const;
  // Byte offset of sequence i in .bin.
  int64_t sequence_pointer(int64_t i) const;
  const std::vector<int64_t>& document_indices() const { return document_indices_; }  // as stored (first 0, last S)
  // tokens [offset, offset + length) of sequence i, converted to int32 (out-of-range values are an Error)
  void read(int64_t sequence, int64_t offset, int64_t length, int32_t* out) const;

  const std::string& prefix() const { return prefix_; }
  const std::string& idx_path() const { return idx_path_; }
  const std::string& bin_path() const { return bin_path_; }
  int64_t idx_bytes() const { return static_cast<int64_t>(idx_.size); }
  int64_t bin_bytes() const { return static_cast<int64_t>(bin_.size); }

 private:
  // A read-only mapping of a whole file (none for an empty file); unmapped on destruction,
  // also when the constructor throws half-way.
  struct Mapping {
    const unsigned char* data = nullptr;
    size_t size = 0;
    Mapping() = default;
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping();
    void map(const std::string& path);
  };
  std::string prefix_, idx_path_, bin_path_;
  Mapping idx_, bin_;
  TokenDType dtype_ = TokenDType::U8;
  int64_t num_sequences_ = 0, num_tokens_ = 0;
  size_t lengths_off_ = 0, pointers_off_ = 0;
  std::vector<int64_t> document_indices_;
};

}  // namespace moecore
