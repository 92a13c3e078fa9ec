// The planner's hardware: one GPU kind's peak throughputs, the fractions of them the kernels
// reach, its memory and the bandwidths between GPUs (NVLink inside a node, the network between
// nodes). Built-in profiles by name (`moecore plan --gpu h100|h200|cpu`); a JSON file
// (--profile FILE.json) overrides any field of the chosen one:
//   {"peak_bf16_tflops": 989, "gemm_efficiency": 0.6, "nvlink_gbps": 450, ...}
// Bandwidths are per GPU and direction, in GB/s; memory in GB (1e9 bytes).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moecore::plan {

struct HardwareProfile {
  std::string name;
  double peak_bf16_tflops = 0;   // dense bf16 tensor-core peak
  double peak_fp8_tflops = 0;    // dense fp8 peak (0: no fp8)
  double gemm_efficiency = 0;    // fraction of the bf16 peak large GEMMs reach
  double fp8_gemm_efficiency = 0;  // fraction of the fp8 peak (blockwise-scaled GEMMs)
  double grouped_gemm_efficiency = 0;  // the experts' grouped GEMMs
  double attention_efficiency = 0;     // the attention kernels
  double memory_gb = 0;          // device memory
  double reserved_gb = 0;        // of it not for the allocator: CUDA context, library workspaces, NCCL
  double hbm_gbps = 0;           // device memory bandwidth
  double nvlink_gbps = 0;        // to a GPU of the same node
  double network_gbps = 0;       // to a GPU of another node
  int gpus_per_node = 8;
  double collective_efficiency = 0.8;  // the fraction of the bandwidth collectives reach
  bool cpu = false;              // the CPU profile: memory checks against this machine, no bf16 peak
  // The rows per expert at which grouped_gemm_efficiency holds; at other counts it follows the
  // row tiles and the weights' reads (step_time.h: grouped_gemm_efficiency_at). Calibration
  // writes the rows it measured at.
  double grouped_gemm_reference_rows = 4096;
  // The fraction of the HBM bandwidth the per-layer small kernels (norms, router, permutation,
  // SwiGLU, residuals, RoPE) reach on the bytes step_time.h counts for them (a guess until
  // calibrated: elementwise kernels reach most of the bandwidth on large tensors, the count leaves
  // out fp32 intermediates and the gaps between launches).
  double small_kernel_efficiency = 0.5;
};

// The built-in names, for messages.
std::vector<std::string> hardware_profile_names();
// A built-in profile by name; an Error naming --gpu and the known names otherwise.
HardwareProfile builtin_hardware_profile(const std::string& name);
// Overrides the fields a JSON object file gives; an Error naming the file and the field for an
// unknown field or a value of the wrong type. A "measured" object (what --calibrate timed, for
// the record) is read past.
void apply_profile_file(HardwareProfile& p, const std::string& path);
// Every field of a profile as the JSON object apply_profile_file reads.
nlohmann::json profile_json(const HardwareProfile& p);

}  // namespace moecore::plan
