// Small readers and writers of HF config.json values shared by the converters (hf_convert.cpp,
// hf_deepseek.cpp).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"

namespace moecore::interop {

// A number as a flag value that reads back to the same double (%.17g).
inline std::string config_number_text(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

// config.json's integer `key`; its absence or another type is an error naming `origin`.
inline int64_t need_int(const nlohmann::json& cfg, const char* key, const std::string& origin) {
  MC_CHECK(cfg.contains(key) && cfg[key].is_number_integer(), origin, ": config.json has no integer '", key, "'");
  return cfg[key].get<int64_t>();
}

}  // namespace moecore::interop
