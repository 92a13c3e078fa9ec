#include "moecore/core/env_switches.h"

#include <cstdlib>
#include <string>

#include "moecore/core/error.h"

namespace moecore {

const char* env_agreement_name(EnvAgreement a) {
  switch (a) {
    case EnvAgreement::PerRank: return "per rank";
    case EnvAgreement::Must: return "must agree";
    case EnvAgreement::Checked: return "must agree (checked)";
  }
  return "?";
}

const std::vector<EnvSwitch>& env_switches() {
  static const std::vector<EnvSwitch> table = {
      {"MOECORE_ATTENTION", "auto, tiled, gemm, flash", "auto",
       "forces the CUDA attention path (ops/attention.h); auto takes flash where supported, else gemm, else tiled; "
       "gemm or flash where unsupported, or another value, is an error. Read at every attention call",
       EnvAgreement::PerRank},
      {"MOECORE_ATTENTION_FLASH_HOPPER", "0, anything else", "on",
       "0 keeps the mma.sync flash kernels on Hopper instead of the sm_90a (TMA + wgmma) ones. Read at every call",
       EnvAgreement::PerRank},
      {"MOECORE_ATTENTION_FLASH_SPLIT", "0, anything else", "on",
       "0: the flash backward rounds P and dS to one bf16 each instead of hi + lo bf16 pairs (faster, less "
       "accurate). Read at every call",
       EnvAgreement::PerRank},
      {"MOECORE_ATTENTION_SCORE_MB", "an integer > 0 (MiB)", "2048",
       "budget of the gemm attention path's fp32 score buffer; the path chunks over (batch, head) to stay under it. "
       "A value that is not a positive integer keeps the default. Read at every call",
       EnvAgreement::PerRank},
      {"MOECORE_COMM_TIMERS", "1 (any value but 0 or empty)", "off",
       "brackets every token-dispatcher collective with device synchronisations and a barrier of its group and "
       "logs the time spent waiting and communicating, and the bytes the token dispatch and the parameter "
       "all-gather move (serialises the step: for measurement runs). Read once",
       EnvAgreement::Must},
      {"MOECORE_FUSED_HEAD", "0, anything else", "on",
       "0 turns off the fused output layer + loss (logits [T, V] kept, no chunking). Read at every forward of the "
       "output layer",
       EnvAgreement::Checked},
      {"MOECORE_FUSED_HEAD_ROWS", "an integer >= 0", "0: 2^27 / vocabulary rows per chunk",
       "rows per chunk of the fused output layer (tests, tuning); another value is an error. Read when a model is "
       "built",
       EnvAgreement::Checked},
      {"MOECORE_GROUPED_GEMM", "auto, loop, grouped, hopper, mixed", "auto",
       "the experts' grouped GEMM implementation (ops/grouped_gemm.h); another value is an error. Read once "
       "(set_grouped_gemm_impl overrides it)",
       EnvAgreement::PerRank},
      {"MOECORE_ROUTER_GEMM", "bf16x3, fp32", "bf16x3",
       "the bf16 GPU router's GEMMs: bf16x3 (three bf16 parts per fp32 operand) or fp32 (cuBLAS, no TF32); another "
       "value is an error. Read at every router forward",
       EnvAgreement::PerRank},
      {"MOECORE_RENDEZVOUS_PORT", "a port 1..65535", "MASTER_PORT (or the 8 next to it under torchrun's agent)",
       "the port of the TCP rendezvous that passes the NCCL id under torchrun (comm/tcp_rendezvous.h)",
       EnvAgreement::Must},
      {"MOECORE_RENDEZVOUS_TIMEOUT", "seconds > 0", "300",
       "how long the TCP rendezvous waits for the other ranks; another value is an error", EnvAgreement::PerRank},
      {"MOECORE_TP_OVERLAP_GEMMS", "auto, chunks", "auto: per chunk on a GPU, once over all rows on the CPU",
       "--tp-comm-overlap: chunks runs the linears' GEMMs per row chunk on the CPU too (tests: the GPU's row "
       "placement on MPI ranks; OpenBLAS may then round a few rows differently); another value is an error. Read "
       "once per process",
       EnvAgreement::PerRank},
  };
  return table;
}

const char* env_switch(std::string_view name) {
  for (const EnvSwitch& s : env_switches())
    if (name == s.name) return std::getenv(s.name);
  MC_FAIL("internal error: environment switch ", std::string(name),
          " is not listed in core/env_switches.cpp (every MOECORE_* switch must be)");
}

}  // namespace moecore
