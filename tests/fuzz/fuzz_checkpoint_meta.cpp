// libFuzzer target for the checkpoint reader: a checkpoint's meta.json text and the header of
// its safetensors file. Either is accepted or refused with moecore::Error; anything else (a
// crash, an ASan/UBSan report, another exception, a hang) is a bug.
//
// Input: byte 0 chooses.
//   even: bytes 1.. are meta.json's text (parse_checkpoint_meta).
//   odd:  bytes 1.. are a .safetensors file, written to a temp file and opened
//         (interop::SafetensorsFile: header parse and validation); every tensor's bytes are then
//         read (raw), and converted to f32 when its dtype allows.
// With MOECORE_FUZZ_SEED_DIR set (scripts/fuzz.sh sets it to the corpus), LLVMFuzzerInitialize
// writes a valid meta.json and valid safetensors files there as seeds.
//
// Built by scripts/fuzz.sh; the lines below name what it compiles and links with this file.
// fuzz-sources: src/moecore/train/checkpoint_meta.cpp src/moecore/interop/safetensors.cpp src/moecore/core/error.cpp src/moecore/core/tensor.cpp src/moecore/core/dtype.cpp src/moecore/core/allocator.cpp src/moecore/core/device.cpp src/moecore/core/memory_ledger.cpp src/moecore/core/memory_categories.cpp
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
#include "moecore/interop/safetensors.h"
#include "moecore/train/checkpoint_meta.h"

namespace {

std::string g_path;  // this process's temp .safetensors file

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

void write_seeds(const std::string& dir) {
  int n = 0;
  auto save = [&](uint8_t kind, const std::vector<uint8_t>& bytes) {
    std::vector<uint8_t> in = {kind};
    in.insert(in.end(), bytes.begin(), bytes.end());
    write_file(dir + "/seed-checkpoint-" + std::to_string(n++), in.data(), in.size());
  };
  const std::string meta =
      R"({"format": "moecore-checkpoint-v1", "iteration": 4, "consumed_samples": 32, "skipped_iterations": 0,)"
      R"( "nan_iterations": 0, "optimizer_offset": 0, "args": [["--num-layers", "2"], ["--lr", "0.001"]],)"
      R"( "crc32c": {"w": 1234, "w.exp_avg": 4294967295}})";
  save(0, std::vector<uint8_t>(meta.begin(), meta.end()));
  const std::string model = R"({"format": "moecore-model-v1", "iteration": 0, "consumed_samples": 0, "args": []})";
  save(0, std::vector<uint8_t>(model.begin(), model.end()));
  using moecore::interop::StDType;
  const std::string tmp = g_path + "_seed";
  moecore::interop::write_safetensors_file(
      tmp, {{"a", StDType::F32, {2, 2}, std::vector<uint8_t>(16, 1)},
            {"b", StDType::BF16, {3}, std::vector<uint8_t>(6, 2)},
            {"c", StDType::I64, {1}, std::vector<uint8_t>(8, 3)}},
      {{"format", "moecore-checkpoint"}});
  save(1, read_file(tmp));
  moecore::interop::write_safetensors_file(tmp, {{"h", StDType::F16, {1, 0}, {}}});
  save(1, read_file(tmp));
  std::remove(tmp.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_path = "/tmp/moecore-fuzz-checkpoint-" + std::to_string(::getpid()) + ".safetensors";
  if (const char* seeds = std::getenv("MOECORE_FUZZ_SEED_DIR")) write_seeds(seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  try {
    if (data[0] % 2 == 0) {
      const moecore::TrainingState s =
          moecore::parse_checkpoint_meta(std::string(reinterpret_cast<const char*>(data + 1), size - 1), "meta.json");
      if (s.iteration < 0 || s.consumed_samples < 0 || s.skipped_iterations < 0 || s.nan_iterations < 0) std::abort();
    } else {
      write_file(g_path, data + 1, size - 1);
      const moecore::interop::SafetensorsFile file(g_path);
      for (const auto& t : file.tensors()) {
        if (t.end < t.begin || t.nbytes() > size) std::abort();
        const std::vector<uint8_t> raw = file.raw(t.name);
        if (raw.size() != t.nbytes()) std::abort();
        using moecore::interop::StDType;
        if (t.dtype == StDType::F32 || t.dtype == StDType::BF16 || t.dtype == StDType::F16) (void)file.read_f32(t.name);
      }
    }
  } catch (const moecore::Error&) {
    // refused with a message: not a finding
  }
  return 0;
}
