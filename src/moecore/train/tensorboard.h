// TensorBoard event-file writer (docs/formats.md): records of
//   u64 length | u32 masked CRC-32C(length) | Event protobuf | u32 masked CRC-32C(data)
// Events are encoded by hand: wall_time (1, double), step (2, int64), file_version (3) for the
// first record, summary (5) { value (1) { tag (1), simple_value (2, float) } }.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace moecore {

uint32_t crc32c(const uint8_t* data, size_t n);
uint32_t masked_crc32c(const uint8_t* data, size_t n);

class TensorBoardWriter {
 public:
  // Creates dir (and parents) and events.out.tfevents.<unix time>.<hostname> inside it.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  void add_scalar(const std::string& tag, double value, int64_t step);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace moecore
