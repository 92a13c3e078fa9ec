#include "moecore/plan/hardware.h"

#include <fstream>
#include <functional>
#include <map>

#include <nlohmann/json.hpp>

#include "moecore/core/error.h"

namespace moecore::plan {

namespace {
// Datasheet peaks (dense, no sparsity). The efficiencies: a large bf16 GEMM reaches about 0.77
// of the peak on these parts and an fp8 one about 0.68 (cuBLAS, 8192^3); the defaults stay a
// little below for the model's smaller GEMMs; grouped GEMMs and attention lower still. Replace
// them by measured ones with --profile.
const std::vector<HardwareProfile>& builtins() {
  static const std::vector<HardwareProfile> list = {
      {"h100", 989, 1979, 0.70, 0.60, 0.60, 0.45, 80, 3, 3350, 450, 50, 8, 0.8, false},
      {"h200", 989, 1979, 0.70, 0.60, 0.60, 0.45, 141, 3, 4800, 450, 50, 8, 0.8, false},
      // The CPU ranks of the tests: memory is what matters; throughputs are nominal.
      {"cpu", 0.05, 0, 0.5, 0, 0.5, 0.5, 0, 0, 20, 5, 5, 1, 0.8, true},
  };
  return list;
}
}  // namespace

std::vector<std::string> hardware_profile_names() {
  std::vector<std::string> names;
  for (const HardwareProfile& p : builtins()) names.push_back(p.name);
  return names;
}

HardwareProfile builtin_hardware_profile(const std::string& name) {
  for (const HardwareProfile& p : builtins())
    if (p.name == name) return p;
  std::string known;
  for (const std::string& n : hardware_profile_names()) known += (known.empty() ? "" : ", ") + n;
  MC_FAIL("--gpu '", name, "' is not a known GPU profile; expected one of ", known,
          " (or give a profile file with --profile)");
}

void apply_profile_file(HardwareProfile& p, const std::string& path) {
  std::ifstream in(path);
  MC_CHECK(in.good(), "--profile: cannot read '", path, "'");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    MC_FAIL("--profile '", path, "' is not valid JSON: ", e.what());
  }
  MC_CHECK(j.is_object(), "--profile '", path, "': expected a JSON object of profile fields");
  const std::map<std::string, double*> numbers = {
      {"peak_bf16_tflops", &p.peak_bf16_tflops}, {"peak_fp8_tflops", &p.peak_fp8_tflops},
      {"gemm_efficiency", &p.gemm_efficiency},   {"fp8_gemm_efficiency", &p.fp8_gemm_efficiency},
      {"grouped_gemm_efficiency", &p.grouped_gemm_efficiency},
      {"attention_efficiency", &p.attention_efficiency}, {"memory_gb", &p.memory_gb},               {"reserved_gb", &p.reserved_gb},
      {"hbm_gbps", &p.hbm_gbps},                 {"nvlink_gbps", &p.nvlink_gbps},
      {"network_gbps", &p.network_gbps},         {"collective_efficiency", &p.collective_efficiency},
      {"grouped_gemm_reference_rows", &p.grouped_gemm_reference_rows},
      {"small_kernel_efficiency", &p.small_kernel_efficiency}};
  for (const auto& [key, value] : j.items()) {
    if (key == "name") {
      MC_CHECK(value.is_string(), "--profile '", path, "': \"name\" must be a string");
      p.name = value.get<std::string>();
      continue;
    }
    if (key == "gpus_per_node") {
      MC_CHECK(value.is_number_integer() && value.get<int>() >= 1, "--profile '", path,
               "': \"gpus_per_node\" must be an integer >= 1");
      p.gpus_per_node = value.get<int>();
      continue;
    }
    if (key == "measured") {  // the calibration's timings, for the record
      MC_CHECK(value.is_object(), "--profile '", path, "': \"measured\" must be an object");
      continue;
    }
    const auto it = numbers.find(key);
    std::string known = "name, gpus_per_node, measured";
    for (const auto& [k, v] : numbers) known += ", " + k;
    MC_CHECK(it != numbers.end(), "--profile '", path, "': unknown field \"", key, "\"; expected one of ", known);
    MC_CHECK(value.is_number() && value.get<double>() >= 0, "--profile '", path, "': \"", key,
             "\" must be a number >= 0");
    MC_CHECK(key.find("efficiency") == std::string::npos || key == "fp8_gemm_efficiency" || value.get<double>() > 0,
             "--profile '", path, "': \"", key, "\" must be > 0 (a fraction of the peak the kernels reach)");
    *it->second = value.get<double>();
  }
}

nlohmann::json profile_json(const HardwareProfile& p) {
  return {{"name", p.name},
          {"peak_bf16_tflops", p.peak_bf16_tflops},
          {"peak_fp8_tflops", p.peak_fp8_tflops},
          {"gemm_efficiency", p.gemm_efficiency},
          {"fp8_gemm_efficiency", p.fp8_gemm_efficiency},
          {"grouped_gemm_efficiency", p.grouped_gemm_efficiency},
          {"grouped_gemm_reference_rows", p.grouped_gemm_reference_rows},
          {"attention_efficiency", p.attention_efficiency},
          {"small_kernel_efficiency", p.small_kernel_efficiency},
          {"memory_gb", p.memory_gb},
          {"reserved_gb", p.reserved_gb},
          {"hbm_gbps", p.hbm_gbps},
          {"nvlink_gbps", p.nvlink_gbps},
          {"network_gbps", p.network_gbps},
          {"gpus_per_node", p.gpus_per_node},
          {"collective_efficiency", p.collective_efficiency}};
}

}  // namespace moecore::plan
