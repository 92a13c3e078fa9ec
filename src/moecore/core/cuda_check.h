// Checked wrappers for CUDA runtime, cuBLAS(Lt) and NCCL calls: a failing call raises an
// Error naming the call, the library's error name and text, and file:line.
// Include only in translation units built with the CUDA backend.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "moecore/core/error.h"

namespace moecore::detail {
[[noreturn]] void raise_cuda(cudaError_t e, const char* expr, const char* file, int line);
[[noreturn]] void raise_cublas(cublasStatus_t s, const char* expr, const char* file, int line);
}  // namespace moecore::detail

#define MC_CUDA_CHECK(expr)                                                                 \
  do {                                                                                      \
    cudaError_t mc_err_ = (expr);                                                           \
    if (mc_err_ != cudaSuccess) ::moecore::detail::raise_cuda(mc_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: catches bad launch configurations at the launch site.
#define MC_CUDA_CHECK_LAUNCH() MC_CUDA_CHECK(cudaGetLastError())

#define MC_CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                        \
    cublasStatus_t mc_st_ = (expr);                                                           \
    if (mc_st_ != CUBLAS_STATUS_SUCCESS) ::moecore::detail::raise_cublas(mc_st_, #expr, __FILE__, __LINE__); \
  } while (0)
