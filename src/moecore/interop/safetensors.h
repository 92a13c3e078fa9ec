// safetensors reader/writer (HF checkpoints; format: docs/formats.md).
//
//   file   = u64 LE N | N bytes of UTF-8 JSON header (space padded to 8) | data
//   header = {"__metadata__": {str: str}?, "<name>": {"dtype", "shape", "data_offsets": [b, e]}}
//   offsets are relative to the data start; the ranges, sorted, are contiguous from 0 and end
//   at the file end; dtype size * prod(shape) == e - b.
// Sharded checkpoints: model.safetensors.index.json {"metadata": {"total_size"}, "weight_map":
// {"<tensor>": "<shard file>"}}.
//
// Reading is memory-mapped and lazy: opening validates the header; a tensor's bytes are touched
// only when asked for (raw bytes kept as stored, or converted to an f32 Tensor for BF16/F16/F32).
// Every error names the file and, where there is one, the tensor.
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moecore/core/tensor.h"

namespace moecore::interop {

enum class StDType { BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64 };

size_t st_dtype_size(StDType t);
const char* st_dtype_name(StDType t);
// Throws an Error naming `where` for an unknown name.
StDType parse_st_dtype(const std::string& name, const std::string& where);

struct StTensorInfo {
  std::string name;
  StDType dtype = StDType::F32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // relative to the data start
  uint64_t nbytes() const { return end - begin; }
};

// One .safetensors file, memory-mapped read-only.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<StTensorInfo>& tensors() const { return tensors_; }  // in offset order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const StTensorInfo* find(const std::string& name) const;
  const StTensorInfo& info(const std::string& name) const;  // Error naming file and tensor when absent
  // The stored bytes (little-endian, row-major), a view into the mapping.
  const uint8_t* data(const StTensorInfo& t) const { return base_ + data_start_ + t.begin; }
  std::vector<uint8_t> raw(const std::string& name) const;
  // BF16, F16 or F32 converted to an f32 CPU tensor; other dtypes are an Error.
  Tensor read_f32(const std::string& name) const;

 private:
  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  uint64_t data_start_ = 0;
  std::vector<StTensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint: one .safetensors file, or a directory holding model.safetensors or
// model.safetensors.index.json with its shards (every shard named by the index must exist and
// hold exactly the tensors the index assigns to it).
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  std::vector<std::string> names() const;  // sorted
  bool has(const std::string& name) const { return where_.count(name) > 0; }
  const StTensorInfo& info(const std::string& name) const;
  const SafetensorsFile& file_of(const std::string& name) const;
  std::vector<uint8_t> raw(const std::string& name) const { return file_of(name).raw(name); }
  Tensor read_f32(const std::string& name) const { return file_of(name).read_f32(name); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
};

// bf16/f16/f32 <-> f32 conversions used by the converter (round to nearest even).
float half_bits_to_float(uint16_t h);
uint16_t float_to_half_bits(float f);
std::vector<uint8_t> f32_to_st_bytes(const float* v, size_t n, StDType to);  // to: BF16, F16 or F32

struct StWriteTensor {
  std::string name;
  StDType dtype = StDType::F32;
  Shape shape;
  std::vector<uint8_t> bytes;
};

// Writes one file (tensors in the given order, header space-padded to a multiple of 8); wrote(n),
// when given, is called after each tensor with its byte count (progress lines).
void write_safetensors_file(const std::string& path, const std::vector<StWriteTensor>& tensors,
                            const std::map<std::string, std::string>& metadata = {},
                            const std::function<void(uint64_t bytes)>& wrote = {});

// One file written tensor by tensor: the header (every tensor's name, dtype and shape, in file
// order) goes first, then each tensor's bytes are written at their offset, in any order, each
// exactly once, so a file larger than host memory can be written from one tensor at a time.
// close() checks that every tensor was written (an Error naming the first missing one) and
// flushes; a writer destroyed unclosed leaves an incomplete file (the caller discards it).
struct StTensorSpec {
  std::string name;
  StDType dtype = StDType::F32;
  Shape shape;
};
class SafetensorsStreamWriter {
 public:
  SafetensorsStreamWriter(const std::string& path, const std::vector<StTensorSpec>& specs,
                          const std::map<std::string, std::string>& metadata = {});
  void write(const std::string& name, const void* bytes, size_t nbytes);
  void close();

 private:
  struct Slot {
    uint64_t offset = 0, nbytes = 0;
    bool written = false;
  };
  std::string path_;
  std::ofstream file_;
  uint64_t data_start_ = 0;
  std::vector<std::string> order_;
  std::map<std::string, Slot> slots_;
};
// Writes `dir`/model.safetensors, or, when the tensors exceed max_shard_bytes, shards
// model-0000i-of-0000K.safetensors (each at most max_shard_bytes unless one tensor is larger)
// and model.safetensors.index.json, after removing such files left in `dir` by an earlier write.
// Returns the files written (shards first). wrote: as for write_safetensors_file.
std::vector<std::string> write_safetensors_checkpoint(const std::string& dir, const std::vector<StWriteTensor>& tensors,
                                                      uint64_t max_shard_bytes,
                                                      const std::function<void(uint64_t bytes)>& wrote = {});
// "5GB", "500MB", "10KB", "123" (bytes); decimal units as HF (1GB = 1e9), "GiB"/"MiB" binary.
uint64_t parse_size(const std::string& text);

}  // namespace moecore::interop
