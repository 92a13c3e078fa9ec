// `moecore env`: what this process sees: devices, library versions, thread counts, and every
// MOECORE_* environment switch (core/env_switches.h) with its value here.
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "moecore/cli/flags.h"
#include "moecore/core/env_switches.h"
#include "moecore/core/system_info.h"

namespace moecore {

namespace {

// The switch table with this process's values (null: unset).
nlohmann::json env_switches_json() {
  nlohmann::json out = nlohmann::json::array();
  for (const EnvSwitch& s : env_switches()) {
    const char* value = env_switch(s.name);
    out.push_back({{"name", s.name},
                   {"value", value ? nlohmann::json(value) : nlohmann::json(nullptr)},
                   {"values", s.values},
                   {"unset", s.unset},
                   {"ranks", env_agreement_name(s.agreement)},
                   {"effect", s.effect}});
  }
  return out;
}

void print_env_switches(const nlohmann::json& switches) {
  std::printf("\nEnvironment switches (docs/environment.md):\n");
  std::printf("  %-31s %-14s %-36s %s\n", "name", "value", "values (unset: default)", "ranks");
  for (const auto& s : switches) {
    std::ostringstream value;  // (g++ 12 warns, -Wrestrict, on "'" + std::string)
    if (s["value"].is_null()) {
      value << "unset";
    } else {
      value << '\'' << s["value"].get<std::string>() << '\'';
    }
    const std::string values = s["values"].get<std::string>() + " (" + s["unset"].get<std::string>() + ")";
    std::printf("  %-31s %-14s %-36s %s\n", s["name"].get<std::string>().c_str(), value.str().c_str(), values.c_str(),
                s["ranks"].get<std::string>().c_str());
  }
}

}  // namespace

int run_env(const std::vector<std::string>& args) {
  bool json = false;
  cli::FlagSet flags("moecore env",
                     "Print the devices, library versions and thread counts moecore sees, and its environment "
                     "switches.");
  flags.add_bool("json", &json, "print one JSON object instead of text");
  flags.parse(args);
  if (flags.help_requested()) {
    std::cout << flags.help();
    return 0;
  }
  nlohmann::json info = system_info();
  info["environment_switches"] = env_switches_json();
  if (json) {
    std::cout << info.dump() << "\n";
    return 0;
  }
  auto get = [&](const char* key) { return info.contains(key) ? info[key].get<std::string>() : std::string("-"); };
  std::printf("moecore        %s (CUDA backend: %s)\n", get("moecore_version").c_str(),
              info["cuda_built"].get<bool>() ? "built" : "not built");
  std::printf("CUDA runtime   %s, driver %s\n", get("cuda_runtime").c_str(), get("cuda_driver").c_str());
  std::printf("cuBLASLt       %s\n", get("cublaslt").c_str());
  std::printf("NCCL           %s\n", get("nccl").c_str());
  std::printf("MPI library    %s\n", get("mpi_library").c_str());
  std::printf("BLAS           %s, %d threads\n", get("blas").c_str(), info["blas_threads"].get<int>());
  std::printf("OpenMP         %d threads\n", info["omp_threads"].get<int>());
  if (info["cuda_devices"].empty()) std::printf("CUDA devices   none: %s\n", get("cuda_unavailable").c_str());
  for (const auto& d : info["cuda_devices"])
    std::printf("cuda:%d         %s, sm_%s, %.1f GiB, %d SMs, L2 %.0f MiB\n", d["index"].get<int>(),
                d["name"].get<std::string>().c_str(), d["compute_capability"].get<std::string>().c_str(),
                d["memory_bytes"].get<double>() / (1 << 30), d["multiprocessors"].get<int>(),
                d["l2_bytes"].get<double>() / (1 << 20));
  print_env_switches(info["environment_switches"]);
  return 0;
}

}  // namespace moecore
