// libFuzzer target for the YAML config reader (cli::FlagSet::load_yaml, `--config`): arbitrary
// bytes as a config file, loaded into a flag set with one flag of each kind. The reader either
// sets flags or refuses with moecore::Error (cli::UsageError is one); anything else (a crash,
// an ASan/UBSan report, another exception such as YAML::Exception, a hang) is a bug.
//
// The input is written to DIR/main.yaml; DIR also holds nested.yaml (a valid config) so that a
// `config: nested.yaml` key reaches the nested load, and `config: main.yaml` the depth limit.
// With MOECORE_FUZZ_SEED_DIR set (scripts/fuzz.sh sets it to the corpus), LLVMFuzzerInitialize
// writes a few valid configs there as seeds.
//
// Built by scripts/fuzz.sh; the lines below name what it compiles and links with this file.
// fuzz-sources: src/moecore/cli/flags.cpp src/moecore/core/error.cpp
// fuzz-libs: -lyaml-cpp
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "moecore/cli/flags.h"
#include "moecore/core/error.h"

namespace {

std::string g_dir;  // this process's temp directory

void write_file(const std::string& path, const void* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
}

void write_text(const std::string& path, const std::string& text) { write_file(path, text.data(), text.size()); }

enum class Schedule { kConstant, kLinear, kCosine };

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_dir = "/tmp/moecore-fuzz-yaml-" + std::to_string(::getpid());
  ::mkdir(g_dir.c_str(), 0700);
  write_text(g_dir + "/nested.yaml", "num_layers: 3\nlr: 0.5\nuse_flash: true\n");
  if (const char* seeds = std::getenv("MOECORE_FUZZ_SEED_DIR")) {
    const std::string dir = seeds;
    write_text(dir + "/seed-yaml-0", "num-layers: 2\nhidden_size: 64\nlr: 1.0e-3\nuse-flash: false\nname: tiny\n");
    write_text(dir + "/seed-yaml-1", "config: nested.yaml\nlr: 0.25\nlr-decay-style: cosine\nmoe-layers: [1, 2, 3]\n");
    write_text(dir + "/seed-yaml-2", "num_layers: 2\nnum-layers: 3\n");
    write_text(dir + "/seed-yaml-3", "# comment\nlr:\nmoe_layers:\n  - a\n  - b\nname: \"x y\"\n");
    write_text(dir + "/seed-yaml-4", "config: main.yaml\n");
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = g_dir + "/main.yaml";
  write_file(path, data, size);
  int64_t num_layers = 1, hidden_size = 8;
  double lr = 0;
  bool use_flash = false;
  std::string name;
  std::vector<std::string> moe_layers;
  Schedule schedule = Schedule::kConstant;
  moecore::cli::FlagSet flags("fuzz", "the YAML config reader under a fuzzer");
  flags.add_int("num-layers", &num_layers, "layers");
  flags.add_int("hidden-size", &hidden_size, "width");
  flags.add_double("lr", &lr, "learning rate");
  flags.add_bool("use-flash", &use_flash, "a switch");
  flags.add_string("name", &name, "a text");
  flags.add_list("moe-layers", &moe_layers, "a list");
  flags.add_enum<Schedule>("lr-decay-style", &schedule,
                           {{"constant", Schedule::kConstant}, {"linear", Schedule::kLinear}, {"cosine", Schedule::kCosine}},
                           "a word");
  try {
    flags.load_yaml(path);
    (void)flags.values();
  } catch (const moecore::Error&) {
    // refused with a message (UsageError derives from Error): not a finding
  }
  return 0;
}
