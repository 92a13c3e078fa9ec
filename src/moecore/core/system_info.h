// What this process runs on: devices, library versions, threads. `moecore env` prints it,
// and benchmarks record it beside their numbers.
#pragma once

#include <nlohmann/json.hpp>

namespace moecore {

// Keys: moecore_version, cuda_built, cuda_runtime, cuda_driver, cublaslt, nccl, mpi_library,
// blas (OpenBLAS config), blas_threads, omp_threads, cuda_devices (list of {index, name,
// compute_capability, memory_bytes, multiprocessors, l2_bytes}), cuda_unavailable (reason).
nlohmann::json system_info();

// Several ranks on one node: unless OMP_NUM_THREADS / OPENBLAS_NUM_THREADS are set, give each
// rank cores / local_ranks host threads (OpenMP and OpenBLAS) instead of every core each, which
// oversubscribes the host and slows the host-side work of every rank; a rank that drives a GPU
// gets at most kGpuRankHostThreads (its host work is light, and idle OpenMP threads spinning
// next to NCCL's and CUDA's host threads can cost step time: EP=4 on four GPUs ran ~17% slower
// with 16 threads per rank than with 4, measured on two different machines, not yet compared in
// one run (docs/performance-log.md, "Third and fourth calls"). Returns the thread count in effect.
inline constexpr int kGpuRankHostThreads = 4;
int configure_host_threads(int local_ranks, bool gpu = false);

}  // namespace moecore
