// safetensors reader/writer: round trip of every dtype, sharding with an index, f32 conversion,
// and damaged files refused with the file (and tensor) named.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>

#include "moecore/core/error.h"
#include "moecore/interop/safetensors.h"

namespace fs = std::filesystem;
using namespace moecore;
using namespace moecore::interop;

namespace {

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("moecore_st_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<uint8_t> bytes_of(size_t n, uint8_t seed) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed * 31 + i * 7);
  return b;
}

// A file written by hand (independent of the writer): header JSON + data.
void write_raw(const fs::path& p, const std::string& header, const std::vector<uint8_t>& data) {
  std::ofstream f(p, std::ios::binary);
  const uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, AllDtypesRoundTripRaw) {
  const fs::path d = temp_dir("dtypes");
  const char* names[] = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"};
  std::vector<StWriteTensor> ts;
  uint8_t seed = 1;
  for (const char* n : names) {
    const StDType t = parse_st_dtype(n, "test");
    EXPECT_STREQ(st_dtype_name(t), n);
    ts.push_back({std::string("t_") + n, t, {2, 3}, bytes_of(6 * st_dtype_size(t), seed++)});
  }
  const fs::path p = d / "all.safetensors";
  write_safetensors_file(p.string(), ts, {{"format", "pt"}});
  // header length is a multiple of 8
  std::ifstream f(p, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  const SafetensorsFile file(p.string());
  EXPECT_EQ(file.metadata().at("format"), "pt");
  ASSERT_EQ(file.tensors().size(), ts.size());
  for (const StWriteTensor& t : ts) {
    const StTensorInfo& info = file.info(t.name);
    EXPECT_EQ(info.dtype, t.dtype) << t.name;
    EXPECT_EQ(info.shape, t.shape) << t.name;
    EXPECT_EQ(file.raw(t.name), t.bytes) << t.name;
  }
  EXPECT_NE(error_of([&] { file.read_f32("t_I32"); }).find("t_I32"), std::string::npos);
  EXPECT_NE(error_of([&] { file.info("nope"); }).find("nope"), std::string::npos);
  fs::remove_all(d);
}

TEST(Safetensors, ReadF32ConvertsBf16F16) {
  const fs::path d = temp_dir("f32");
  // bf16 1.5 = 0x3fc0, -2 = 0xc000; f16 1.5 = 0x3e00, -2 = 0xc000, 2^-24 = 0x0001 (subnormal)
  const std::vector<uint8_t> data = {0xc0, 0x3f, 0x00, 0xc0, 0x00, 0x3e, 0x00, 0xc0, 0x01, 0x00, 0x00, 0x00};
  std::string h = R"({"b":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"h":{"dtype":"F16","shape":[3],"data_offsets":[4,10]},"p":{"dtype":"U8","shape":[2],"data_offsets":[10,12]}})";
  write_raw(d / "x.safetensors", h, data);
  const SafetensorsFile file((d / "x.safetensors").string());
  EXPECT_EQ(file.read_f32("b").to_vector<float>(), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(file.read_f32("h").to_vector<float>(), (std::vector<float>{1.5f, -2.0f, std::ldexp(1.0f, -24)}));
  for (float x : {1.5f, -2.0f, 65504.0f, std::ldexp(1.0f, -24), std::ldexp(3.0f, -20), 0.1f})
    EXPECT_EQ(half_bits_to_float(float_to_half_bits(x)), x == 0.1f ? half_bits_to_float(0x2e66) : x) << x;
  fs::remove_all(d);
}

TEST(Safetensors, ShardedWriteAndReadThroughIndex) {
  const fs::path d = temp_dir("shard");
  std::vector<StWriteTensor> ts;
  for (int i = 0; i < 5; ++i) ts.push_back({"w" + std::to_string(i), StDType::F32, {10}, bytes_of(40, static_cast<uint8_t>(i))});
  const auto files = write_safetensors_checkpoint(d.string(), ts, 100);  // two tensors per shard
  ASSERT_EQ(files.size(), 4u);
  EXPECT_TRUE(fs::exists(d / "model-00001-of-00003.safetensors"));
  EXPECT_TRUE(fs::exists(d / "model.safetensors.index.json"));
  const SafetensorsReader r(d.string());
  ASSERT_EQ(r.names().size(), 5u);
  for (const StWriteTensor& t : ts) EXPECT_EQ(r.raw(t.name), t.bytes);
  EXPECT_EQ(r.file_of("w4").path(), (d / "model-00003-of-00003.safetensors").string());
  // an index naming a shard that does not hold the tensor
  {
    std::ofstream f(d / "model.safetensors.index.json");
    f << R"({"metadata":{},"weight_map":{"w0":"model-00002-of-00003.safetensors"}})";
  }
  const std::string msg = error_of([&] { SafetensorsReader bad(d.string()); });
  EXPECT_NE(msg.find("w0"), std::string::npos) << msg;
  fs::remove_all(d);
}

TEST(Safetensors, ParseSize) {
  EXPECT_EQ(parse_size("5GB"), 5000000000ull);
  EXPECT_EQ(parse_size("500MB"), 500000000ull);
  EXPECT_EQ(parse_size("2KiB"), 2048ull);
  EXPECT_EQ(parse_size("123"), 123ull);
  EXPECT_NE(error_of([] { parse_size("5XB"); }).find("5XB"), std::string::npos);
}

TEST(Safetensors, DamagedFilesNameTheFile) {
  const fs::path d = temp_dir("damage");
  const std::vector<uint8_t> data(16, 0);
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  write_raw(d / "good.safetensors", good, data);
  EXPECT_NO_THROW(SafetensorsFile((d / "good.safetensors").string()));

  auto expect_refused = [&](const std::string& name, const std::string& header, const std::vector<uint8_t>& bytes,
                            const std::string& needle) {
    const fs::path p = d / (name + ".safetensors");
    write_raw(p, header, bytes);
    const std::string msg = error_of([&] { SafetensorsFile f(p.string()); });
    EXPECT_NE(msg.find(p.string()), std::string::npos) << name << ": " << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << name << ": " << msg;
  };
  // truncated: the data section is shorter than the offsets say
  expect_refused("truncated", good, std::vector<uint8_t>(12, 0), "'b'");
  // offsets beyond the end
  expect_refused("bad_offsets", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,24]}})",
                 data, "'b'");
  // a gap between tensors
  expect_refused("gap", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                 data, "gap");
  // bytes do not match dtype x shape
  expect_refused("bytes", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                 data, "'a'");
  // trailing bytes after the last tensor
  expect_refused("trailing", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data, "trailing");
  // unknown dtype
  expect_refused("dtype", R"({"a":{"dtype":"F12","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                 data, "F12");
  // element counts that overflow int64, or bytes that overflow uint64 (found by fuzz_checkpoint_meta:
  // they wrapped to 0 and passed the size check, then overflowed in shape_numel / the allocation)
  expect_refused("numel_overflow", R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", {},
                 "more elements than a tensor can hold");
  expect_refused("numel_overflow_before_zero", R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})",
                 {}, "more elements than a tensor can hold");
  expect_refused("dim_overflow", R"({"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0]}})", {},
                 "more elements than a tensor can hold");
  expect_refused("bytes_overflow", R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", {},
                 "more bytes than a tensor can hold");
  // header length beyond the file
  {
    const fs::path p = d / "short.safetensors";
    std::ofstream f(p, std::ios::binary);
    const uint64_t n = 1000;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
    f.close();
    const std::string msg = error_of([&] { SafetensorsFile x(p.string()); });
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  }
  fs::remove_all(d);
}

// The streaming writer lays out the header first and takes the tensors in any order: the file is
// byte for byte the one-call writer's; a tensor missing at close, written twice, unknown, or of
// the wrong size is an Error naming file and tensor.
TEST(Safetensors, StreamWriterTakesTensorsInAnyOrder) {
  const fs::path d = temp_dir("stream");
  const std::vector<StWriteTensor> tensors = {{"a", StDType::F32, {2, 3}, bytes_of(24, 1)},
                                              {"b", StDType::BF16, {5}, bytes_of(10, 2)},
                                              {"c", StDType::I64, {1, 2}, bytes_of(16, 3)}};
  write_safetensors_file((d / "whole.safetensors").string(), tensors, {{"k", "v"}});
  std::vector<StTensorSpec> specs;
  for (const auto& t : tensors) specs.push_back({t.name, t.dtype, t.shape});
  {
    SafetensorsStreamWriter out((d / "stream.safetensors").string(), specs, {{"k", "v"}});
    for (int i : {2, 0, 1}) out.write(tensors[i].name, tensors[i].bytes.data(), tensors[i].bytes.size());
    out.close();
  }
  auto read = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  EXPECT_EQ(read(d / "stream.safetensors"), read(d / "whole.safetensors"));
  const SafetensorsFile f((d / "stream.safetensors").string());
  EXPECT_EQ(f.raw("b"), tensors[1].bytes);

  const std::string path = (d / "bad.safetensors").string();
  SafetensorsStreamWriter out(path, specs);
  out.write("a", tensors[0].bytes.data(), tensors[0].bytes.size());
  EXPECT_NE(error_of([&] { out.write("a", tensors[0].bytes.data(), tensors[0].bytes.size()); }).find("'a' written twice"),
            std::string::npos);
  EXPECT_NE(error_of([&] { out.write("zz", tensors[0].bytes.data(), 4); }).find("'zz' is not in the header"),
            std::string::npos);
  EXPECT_NE(error_of([&] { out.write("b", tensors[1].bytes.data(), 3); }).find("'b' has 3 bytes, the header says 10"),
            std::string::npos);
  EXPECT_NE(error_of([&] { out.close(); }).find("tensor 'b' was never written"), std::string::npos);
  fs::remove_all(d);
}
