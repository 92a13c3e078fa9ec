#include "moecore/train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "moecore/core/error.h"

namespace moecore {

uint32_t crc32c(const uint8_t* data, size_t n) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // Castagnoli, reflected
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ data[i]) & 0xFFu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const uint8_t* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

namespace {
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_bytes_field(std::string& out, int field, const std::string& bytes) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | 2);
  put_varint(out, bytes.size());
  out += bytes;
}
template <typename T>
void put_fixed(std::string& out, int field, int wire, T value) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | static_cast<uint64_t>(wire));
  char buf[sizeof(T)];
  std::memcpy(buf, &value, sizeof(T));  // little-endian hosts
  out.append(buf, sizeof(T));
}
std::string event_header(int64_t step) {
  std::string ev;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  put_fixed(ev, 1, 1, now);
  put_varint(ev, (2u << 3) | 0);
  put_varint(ev, static_cast<uint64_t>(step));
  return ev;
}
}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MC_CHECK(!ec, "--tensorboard-dir '", dir, "': cannot create it: ", ec.message());
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch());
  path_ = dir + "/events.out.tfevents." + std::to_string(secs.count()) + "." + host;
  file_ = std::fopen(path_.c_str(), "wb");
  MC_CHECK(file_ != nullptr, "--tensorboard-dir: cannot write '", path_, "'");
  std::string ev = event_header(0);
  put_bytes_field(ev, 3, "brain.Event:2");
  write_record(ev);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::write_record(const std::string& data) {
  const uint64_t len = data.size();
  uint8_t header[8];
  std::memcpy(header, &len, 8);
  const uint32_t len_crc = masked_crc32c(header, 8);
  const uint32_t data_crc = masked_crc32c(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  std::fwrite(header, 1, 8, file_);
  std::fwrite(&len_crc, 4, 1, file_);
  std::fwrite(data.data(), 1, data.size(), file_);
  std::fwrite(&data_crc, 4, 1, file_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  std::string v;
  put_bytes_field(v, 1, tag);
  put_fixed(v, 2, 5, static_cast<float>(value));
  std::string summary;
  put_bytes_field(summary, 1, v);
  std::string ev = event_header(step);
  put_bytes_field(ev, 5, summary);
  write_record(ev);
}

void TensorBoardWriter::flush() { std::fflush(file_); }

}  // namespace moecore
