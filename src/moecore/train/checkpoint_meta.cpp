// meta.json parsing and validation (see checkpoint_meta.h).
#include "moecore/train/checkpoint_meta.h"

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"

namespace moecore {

namespace {
// meta.json's fields: the required keys with their types and ranges, each failure naming the file.
void validate_meta(const nlohmann::json& meta, const std::string& file) {
  const std::string where = "'" + file + "'";
  MC_CHECK(meta.is_object(), where, ": expected a JSON object");
  for (const char* key : {"format", "iteration", "consumed_samples", "args"})
    MC_CHECK(meta.contains(key), where, ": the required key \"", key, "\" is missing");
  MC_CHECK(meta["format"].is_string(), where, ": \"format\" must be a string");
  for (const char* key : {"iteration", "consumed_samples", "skipped_iterations", "nan_iterations", "optimizer_offset"}) {
    if (!meta.contains(key)) continue;
    const nlohmann::json& v = meta[key];
    MC_CHECK(v.is_number_integer(), where, ": \"", key, "\" must be an integer, got ", v.dump());
    MC_CHECK(v.get<int64_t>() >= 0, where, ": \"", key, "\" is ", v.get<int64_t>(), "; expected >= 0");
  }
  bool pairs = meta["args"].is_array();
  for (const auto& item : meta["args"])
    pairs = pairs && item.is_array() && item.size() == 2 && item[0].is_string() && item[1].is_string();
  MC_CHECK(pairs, where, ": \"args\" must be a list of [flag, value] pairs of strings (the train flags)");
  if (meta.contains("crc32c")) {
    bool ok = meta["crc32c"].is_object();
    for (const auto& [name, v] : meta["crc32c"].items())
      ok = ok && v.is_number_unsigned() && v.get<uint64_t>() <= 0xFFFFFFFFull;
    MC_CHECK(ok, where, ": \"crc32c\" must map tensor names to 32-bit checksums");
  }
}
}  // namespace

TrainingState parse_checkpoint_meta(const std::string& text, const std::string& file) {
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    MC_FAIL("'", file, "' is not valid JSON: ", e.what());
  }
  validate_meta(meta, file);
  const std::string format = meta.value("format", "");
  MC_CHECK(format == "moecore-checkpoint-v1" || format == "moecore-model-v1", "'", file,
           "': unknown checkpoint format '", format, "'");
  TrainingState s;
  s.model_only = format == "moecore-model-v1";
  try {
    s.iteration = meta.at("iteration").get<int64_t>();
    s.consumed_samples = meta.at("consumed_samples").get<int64_t>();
    s.skipped_iterations = meta.value("skipped_iterations", int64_t{0});
    s.nan_iterations = meta.value("nan_iterations", int64_t{0});
    s.optimizer_offset = meta.value("optimizer_offset", int64_t{0});
    if (meta.contains("args")) s.args = meta.at("args").get<std::vector<std::pair<std::string, std::string>>>();
  } catch (const nlohmann::json::exception& e) {
    MC_FAIL("'", file, "': ", e.what());
  }
  return s;
}

}  // namespace moecore
