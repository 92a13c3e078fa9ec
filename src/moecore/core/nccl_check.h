// Checked wrapper for NCCL calls (CUDA backend only).
#pragma once

#include <nccl.h>

#include "moecore/core/error.h"

namespace moecore::detail {
[[noreturn]] void raise_nccl(ncclResult_t r, const char* expr, const char* file, int line);
}

#define MC_NCCL_CHECK(expr)                                                                  \
  do {                                                                                       \
    ncclResult_t mc_r_ = (expr);                                                             \
    if (mc_r_ != ncclSuccess) ::moecore::detail::raise_nccl(mc_r_, #expr, __FILE__, __LINE__); \
  } while (0)
