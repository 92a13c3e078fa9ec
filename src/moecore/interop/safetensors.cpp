#include "moecore/interop/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"
#include "moecore/core/float_formats.h"

namespace fs = std::filesystem;

namespace moecore::interop {

namespace {
struct DTypeEntry {
  StDType t;
  const char* name;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {StDType::BOOL, "BOOL", 1}, {StDType::U8, "U8", 1},   {StDType::I8, "I8", 1},   {StDType::F8_E5M2, "F8_E5M2", 1},
    {StDType::F8_E4M3, "F8_E4M3", 1}, {StDType::I16, "I16", 2}, {StDType::U16, "U16", 2}, {StDType::F16, "F16", 2},
    {StDType::BF16, "BF16", 2}, {StDType::I32, "I32", 4}, {StDType::U32, "U32", 4}, {StDType::F32, "F32", 4},
    {StDType::F64, "F64", 8},   {StDType::I64, "I64", 8}, {StDType::U64, "U64", 8}};
}  // namespace

size_t st_dtype_size(StDType t) {
  for (const auto& e : kDTypes)
    if (e.t == t) return e.size;
  return 0;
}
const char* st_dtype_name(StDType t) {
  for (const auto& e : kDTypes)
    if (e.t == t) return e.name;
  return "?";
}
StDType parse_st_dtype(const std::string& name, const std::string& where) {
  for (const auto& e : kDTypes)
    if (name == e.name) return e.t;
  MC_FAIL(where, ": unknown safetensors dtype '", name,
          "' (expected BOOL U8 I8 F8_E5M2 F8_E4M3 I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64)");
}

float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits = 0;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u);  // nan / inf
  if (abs >= 0x477ff000u) return sign | 0x7c00u;                                  // overflow to inf
  if (abs < 0x38800000u) {                                                        // subnormal or zero
    if (abs < 0x33000000u) return sign;
    const uint32_t e = abs >> 23, m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e) ... value = m * 2^(e-150); half unit 2^-24
    const uint32_t q = m >> (shift - 0), r = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    uint32_t res = q;
    if (r > halfway || (r == halfway && (q & 1u))) ++res;
    return sign | static_cast<uint16_t>(res);
  }
  uint32_t res = ((abs >> 13) - (112u << 10));
  const uint32_t r = abs & 0x1fffu;
  if (r > 0x1000u || (r == 0x1000u && (res & 1u))) ++res;
  return sign | static_cast<uint16_t>(res);
}

std::vector<uint8_t> f32_to_st_bytes(const float* v, size_t n, StDType to) {
  std::vector<uint8_t> out(n * st_dtype_size(to));
  if (to == StDType::F32) {
    std::memcpy(out.data(), v, n * 4);
  } else if (to == StDType::BF16) {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t b = float_to_bf16_bits(v[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  } else if (to == StDType::F16) {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t b = float_to_half_bits(v[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  } else {
    MC_FAIL("cannot store f32 values as safetensors ", st_dtype_name(to), " (BF16, F16 or F32 only)");
  }
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const std::string where = "safetensors file '" + path + "'";
  const int fd = ::open(path.c_str(), O_RDONLY);
  MC_CHECK(fd >= 0, "cannot open ", where);
  struct stat st {};
  ::fstat(fd, &st);
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    MC_CHECK(p != MAP_FAILED, "cannot map ", where, " into memory");
    base_ = static_cast<const uint8_t*>(p);
  } else {
    ::close(fd);
  }
  try {
    MC_CHECK(size_ >= 8, where, " is too short (", size_, " bytes) to hold a header");
    uint64_t n = 0;
    std::memcpy(&n, base_, 8);
    MC_CHECK(n >= 2 && n <= size_ - 8, where, ": header length ", n, " does not fit the file of ", size_,
             " bytes (truncated?)");
    data_start_ = 8 + n;
    const uint64_t data_size = size_ - data_start_;
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(reinterpret_cast<const char*>(base_) + 8, reinterpret_cast<const char*>(base_) + 8 + n);
    } catch (const std::exception& e) {
      MC_FAIL(where, ": the header is not valid JSON: ", e.what());
    }
    MC_CHECK(header.is_object(), where, ": the header is not a JSON object");
    for (auto& [name, v] : header.items()) {
      if (name == "__metadata__") {
        MC_CHECK(v.is_object(), where, ": __metadata__ is not an object");
        for (auto& [k, s] : v.items()) {
          MC_CHECK(s.is_string(), where, ": __metadata__ value '", k, "' is not a string");
          metadata_[k] = s.get<std::string>();
        }
        continue;
      }
      const std::string tw = where + ", tensor '" + name + "'";
      MC_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"), tw,
               ": expected {\"dtype\", \"shape\", \"data_offsets\"}");
      StTensorInfo t;
      t.name = name;
      MC_CHECK(v["dtype"].is_string(), tw, ": dtype is not a string");
      t.dtype = parse_st_dtype(v["dtype"].get<std::string>(), tw);
      MC_CHECK(v["shape"].is_array(), tw, ": shape is not a list");
      // The element count must fit int64 (a Tensor's numel), also where a zero dimension follows.
      uint64_t numel = 1;
      bool fits = true;
      for (const auto& d : v["shape"]) {
        MC_CHECK(d.is_number_unsigned(), tw, ": shape ", v["shape"].dump(), " has an entry that is not a size");
        const uint64_t n = d.get<uint64_t>();
        t.shape.push_back(static_cast<int64_t>(n));
        int64_t product = 0;
        fits = fits && n <= static_cast<uint64_t>(INT64_MAX) &&
               !__builtin_mul_overflow(static_cast<int64_t>(numel), static_cast<int64_t>(n), &product);
        numel = fits ? static_cast<uint64_t>(product) : 0;
      }
      MC_CHECK(fits, tw, ": shape ", v["shape"].dump(), " has more elements than a tensor can hold");
      const auto& o = v["data_offsets"];
      MC_CHECK(o.is_array() && o.size() == 2 && o[0].is_number_unsigned() && o[1].is_number_unsigned(), tw,
               ": data_offsets must be [begin, end]");
      t.begin = o[0].get<uint64_t>();
      t.end = o[1].get<uint64_t>();
      MC_CHECK(t.begin <= t.end && t.end <= data_size, tw, ": data_offsets [", t.begin, ", ", t.end,
               "] lie outside the data section of ", data_size, " bytes (truncated file?)");
      uint64_t needed = 0;
      MC_CHECK(!__builtin_mul_overflow(numel, uint64_t{st_dtype_size(t.dtype)}, &needed), tw, ": shape ",
               v["shape"].dump(), " has more bytes than a tensor can hold");
      MC_CHECK(t.nbytes() == needed, tw, ": ", t.nbytes(), " bytes stored but ", st_dtype_name(t.dtype), " ",
               shape_str(t.shape), " needs ", needed);
      tensors_.push_back(std::move(t));
    }
    std::stable_sort(tensors_.begin(), tensors_.end(), [](const StTensorInfo& a, const StTensorInfo& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t expect = 0;
    for (const StTensorInfo& t : tensors_) {
      MC_CHECK(t.begin == expect, where, ", tensor '", t.name, "': data starts at ", t.begin, " but the previous ",
               "tensor ends at ", expect, t.begin > expect ? " (a gap between tensors)" : " (overlapping tensors)");
      expect = t.end;
    }
    MC_CHECK(expect == data_size, where, ": the tensors end at data offset ", expect, " but the data section has ",
             data_size, " bytes (", expect < data_size ? "trailing bytes" : "truncated", ")");
    for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
  } catch (...) {
    if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
    base_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
}

const StTensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const StTensorInfo& SafetensorsFile::info(const std::string& name) const {
  const StTensorInfo* t = find(name);
  MC_CHECK(t, "safetensors file '", path_, "' has no tensor '", name, "'");
  return *t;
}

std::vector<uint8_t> SafetensorsFile::raw(const std::string& name) const {
  const StTensorInfo& t = info(name);
  const uint8_t* p = data(t);
  return std::vector<uint8_t>(p, p + t.nbytes());
}

Tensor SafetensorsFile::read_f32(const std::string& name) const {
  const StTensorInfo& t = info(name);
  Tensor out = Tensor::empty(t.shape, DType::F32);
  float* o = static_cast<float*>(out.data_ptr());
  const uint8_t* p = data(t);
  const size_t n = t.nbytes() / st_dtype_size(t.dtype);
  if (t.dtype == StDType::F32) {
    std::memcpy(o, p, n * 4);
  } else if (t.dtype == StDType::BF16 || t.dtype == StDType::F16) {
    for (size_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      if (t.dtype == StDType::BF16) {
        const uint32_t bits = static_cast<uint32_t>(b) << 16;
        std::memcpy(o + i, &bits, 4);
      } else {
        o[i] = half_bits_to_float(b);
      }
    }
  } else {
    MC_FAIL("safetensors file '", path_, "', tensor '", name, "': dtype ", st_dtype_name(t.dtype),
            " cannot be read as f32 (BF16, F16 or F32 only)");
  }
  return out;
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  const fs::path p = path;
  MC_CHECK(fs::exists(p), "'", path, "': no such file or directory");
  auto add_file = [&](const fs::path& f) {
    files_.push_back(std::make_unique<SafetensorsFile>(f.string()));
    return files_.size() - 1;
  };
  if (!fs::is_directory(p)) {
    const size_t i = add_file(p);
    for (const auto& t : files_[i]->tensors()) where_[t.name] = i;
    return;
  }
  const fs::path index = p / "model.safetensors.index.json";
  if (fs::exists(index)) {
    nlohmann::json j;
    try {
      std::ifstream f(index);
      j = nlohmann::json::parse(f);
    } catch (const std::exception& e) {
      MC_FAIL("'", index.string(), "' is not valid JSON: ", e.what());
    }
    MC_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "'", index.string(), "' has no weight_map object");
    std::map<std::string, size_t> shard_index;
    for (auto& [name, shard] : j["weight_map"].items()) {
      MC_CHECK(shard.is_string(), "'", index.string(), "': weight_map entry '", name, "' is not a file name");
      const std::string s = shard.get<std::string>();
      if (!shard_index.count(s)) {
        MC_CHECK(fs::exists(p / s), "'", index.string(), "' names shard '", s, "' (for tensor '", name,
                 "') but it does not exist");
        shard_index[s] = add_file(p / s);
      }
      const size_t i = shard_index[s];
      MC_CHECK(files_[i]->find(name), "'", index.string(), "' places tensor '", name, "' in '", s,
               "' but that shard does not hold it");
      where_[name] = i;
    }
    for (const auto& [s, i] : shard_index)
      for (const auto& t : files_[i]->tensors())
        MC_CHECK(where_.count(t.name) && where_[t.name] == i, "shard '", (p / s).string(), "' holds tensor '", t.name,
                 "' that '", index.string(), "' does not place there");
    return;
  }
  const fs::path single = p / "model.safetensors";
  MC_CHECK(fs::exists(single), "'", path, "' holds neither model.safetensors nor model.safetensors.index.json");
  const size_t i = add_file(single);
  for (const auto& t : files_[i]->tensors()) where_[t.name] = i;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  for (const auto& [n, i] : where_) out.push_back(n);
  return out;
}

const SafetensorsFile& SafetensorsReader::file_of(const std::string& name) const {
  auto it = where_.find(name);
  MC_CHECK(it != where_.end(), "checkpoint '", path_, "' has no tensor '", name, "'");
  return *files_[it->second];
}

const StTensorInfo& SafetensorsReader::info(const std::string& name) const { return file_of(name).info(name); }

SafetensorsStreamWriter::SafetensorsStreamWriter(const std::string& path, const std::vector<StTensorSpec>& specs,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(path) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const StTensorSpec& t : specs) {
    MC_CHECK(!slots_.count(t.name), "writing '", path, "': tensor '", t.name, "' given twice");
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    const uint64_t nbytes = numel * st_dtype_size(t.dtype);
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + nbytes}}};
    slots_[t.name] = {offset, nbytes, false};
    order_.push_back(t.name);
    offset += nbytes;
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  file_.open(path, std::ios::binary | std::ios::trunc);
  MC_CHECK(file_.good(), "cannot write '", path, "'");
  const uint64_t n = h.size();
  file_.write(reinterpret_cast<const char*>(&n), 8);
  file_.write(h.data(), static_cast<std::streamsize>(h.size()));
  data_start_ = 8 + n;
  MC_CHECK(!file_.fail(), "writing '", path, "' failed (disk full?)");
}

void SafetensorsStreamWriter::write(const std::string& name, const void* bytes, size_t nbytes) {
  const auto it = slots_.find(name);
  MC_CHECK(it != slots_.end(), "writing '", path_, "': tensor '", name, "' is not in the header");
  Slot& slot = it->second;
  MC_CHECK(!slot.written, "writing '", path_, "': tensor '", name, "' written twice");
  MC_CHECK(nbytes == slot.nbytes, "writing '", path_, "': tensor '", name, "' has ", nbytes, " bytes, the header says ",
           slot.nbytes);
  file_.seekp(static_cast<std::streamoff>(data_start_ + slot.offset));
  file_.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(nbytes));
  MC_CHECK(!file_.fail(), "writing '", path_, "' failed (disk full?)");
  slot.written = true;
}

void SafetensorsStreamWriter::close() {
  for (const std::string& name : order_)
    MC_CHECK(slots_.at(name).written, "writing '", path_, "': tensor '", name, "' was never written");
  file_.close();
  MC_CHECK(!file_.fail(), "writing '", path_, "' failed (disk full?)");
}

void write_safetensors_file(const std::string& path, const std::vector<StWriteTensor>& tensors,
                            const std::map<std::string, std::string>& metadata,
                            const std::function<void(uint64_t bytes)>& wrote) {
  std::vector<StTensorSpec> specs;
  for (const StWriteTensor& t : tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    MC_CHECK(t.bytes.size() == numel * st_dtype_size(t.dtype), "writing '", path, "': tensor '", t.name, "' has ",
             t.bytes.size(), " bytes for ", st_dtype_name(t.dtype), " ", shape_str(t.shape));
    specs.push_back({t.name, t.dtype, t.shape});
  }
  SafetensorsStreamWriter out(path, specs, metadata);
  for (const StWriteTensor& t : tensors) {
    out.write(t.name, t.bytes.data(), t.bytes.size());
    if (wrote) wrote(t.bytes.size());
  }
  out.close();
}

std::vector<std::string> write_safetensors_checkpoint(const std::string& dir, const std::vector<StWriteTensor>& tensors,
                                                      uint64_t max_shard_bytes,
                                                      const std::function<void(uint64_t bytes)>& wrote) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  MC_CHECK(!ec, "cannot create '", dir, "': ", ec.message());
  MC_CHECK(max_shard_bytes > 0, "the maximum shard size must be > 0");
  // A previous checkpoint's files there would mix with this one (the index wins when reading).
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string n = entry.path().filename().string();
    if (n == "model.safetensors" || n == "model.safetensors.index.json" ||
        (n.rfind("model-", 0) == 0 && n.find("-of-") != std::string::npos && n.ends_with(".safetensors")))
      fs::remove(entry.path());
  }
  std::vector<std::vector<size_t>> shards(1);
  uint64_t cur = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t b = tensors[i].bytes.size();
    if (!shards.back().empty() && cur + b > max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += b;
    total += b;
  }
  std::vector<std::string> written;
  if (shards.size() == 1) {
    const std::string path = (fs::path(dir) / "model.safetensors").string();
    write_safetensors_file(path, tensors, {{"format", "pt"}}, wrote);
    return {path};
  }
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    std::vector<StWriteTensor> part;
    for (size_t i : shards[s]) {
      part.push_back(tensors[i]);
      map[tensors[i].name] = name;
    }
    const std::string path = (fs::path(dir) / name).string();
    write_safetensors_file(path, part, {{"format", "pt"}}, wrote);
    written.push_back(path);
  }
  const nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
  const std::string ipath = (fs::path(dir) / "model.safetensors.index.json").string();
  std::ofstream f(ipath, std::ios::trunc);
  MC_CHECK(f.good(), "cannot write '", ipath, "'");
  f << index.dump(2) << "\n";
  f.close();
  MC_CHECK(!f.fail(), "writing '", ipath, "' failed (disk full?)");
  written.push_back(ipath);
  return written;
}

uint64_t parse_size(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  MC_CHECK(i > 0, "size '", text, "': expected a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)");
  double v = 0;
  try {
    v = std::stod(text.substr(0, i));
  } catch (...) {
    MC_FAIL("size '", text, "': expected a number with an optional unit");
  }
  std::string unit = text.substr(i);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "TB") mult = 1e12;
  else if (unit == "KIB") mult = 1024.0;
  else if (unit == "MIB") mult = 1024.0 * 1024;
  else if (unit == "GIB") mult = 1024.0 * 1024 * 1024;
  else MC_FAIL("size '", text, "': unknown unit '", text.substr(i), "' (B, KB, MB, GB, TB, KiB, MiB, GiB)");
  const double bytes = v * mult;
  MC_CHECK(bytes >= 1, "size '", text, "' must be at least one byte");
  return static_cast<uint64_t>(bytes);
}

}  // namespace moecore::interop
