// libFuzzer target for the JSONL line reader and field extraction of `moecore preprocess`.
// Built by scripts/fuzz.sh jsonl, which compiles the moecore sources named below into it
// (nlohmann-json is header-only). Input: arbitrary bytes as a JSONL file.
// fuzz-sources: src/moecore/core/error.cpp src/moecore/data/jsonl.cpp
// fuzz-libs:
// Checks: no crash, no exception other than moecore::Error (line too long); every line has no
// '\n', line numbers strictly increase, the bytes consumed never exceed the input, and
// extraction either succeeds with one value per key or gives a message.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/core/error.h"
#include "moecore/data/jsonl.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  auto reader = moecore::JsonlLineReader::from_buffer(input);
  reader.set_max_line_bytes(1 << 16);
  const std::vector<std::string> keys = {"text", "title"};
  std::vector<std::string> values;
  std::string line;
  int64_t number = 0, previous = 0;
  try {
    while (reader.next(line, number)) {
      if (number <= previous || line.find('\n') != std::string::npos) std::abort();
      if (reader.bytes_read() > static_cast<int64_t>(size)) std::abort();
      previous = number;
      const std::string problem = moecore::parse_jsonl_fields(line, keys, values);
      if (problem.empty() ? values.size() != keys.size() : !values.empty() && values.size() >= keys.size())
        std::abort();
    }
  } catch (const moecore::Error&) {
    // a line longer than the limit: reported, not a crash
  }
  return 0;
}
