#include "moecore/core/system_info.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "moecore/core/device.h"
#include "moecore/core/mpi_check.h"

#if MOECORE_WITH_CUDA
#include <nccl.h>

#include "moecore/core/cuda_check.h"
#endif

extern "C" {
int openblas_get_num_threads(void);
void openblas_set_num_threads(int);
char* openblas_get_config(void);
}

namespace moecore {

namespace {
[[maybe_unused]] std::string version_text(int v, int major_div, int minor_div, int minor_mod) {
  return std::to_string(v / major_div) + "." + std::to_string((v / minor_div) % minor_mod);
}
}  // namespace

nlohmann::json system_info() {
  nlohmann::json j;
  j["moecore_version"] = MOECORE_VERSION;
  j["cuda_built"] = cuda_built();
  j["mpi_library"] = mpi_library_version();
  j["blas"] = std::string(openblas_get_config());
  j["blas_threads"] = openblas_get_num_threads();
  j["omp_threads"] = omp_get_max_threads();
  j["cuda_devices"] = nlohmann::json::array();
#if MOECORE_WITH_CUDA
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  j["cuda_runtime"] = version_text(runtime, 1000, 10, 100);
  if (cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0) j["cuda_driver"] = version_text(driver, 1000, 10, 100);
  const size_t lt = cublasLtGetVersion();
  j["cublaslt"] = std::to_string(lt / 10000) + "." + std::to_string((lt / 100) % 100) + "." + std::to_string(lt % 100);
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess)
    j["nccl"] = std::to_string(nccl / 10000) + "." + std::to_string((nccl / 100) % 100) + "." + std::to_string(nccl % 100);
  const int count = cuda_device_count();
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    MC_CUDA_CHECK(cudaGetDeviceProperties(&p, i));
    j["cuda_devices"].push_back({{"index", i},
                                 {"name", p.name},
                                 {"compute_capability", std::to_string(p.major) + "." + std::to_string(p.minor)},
                                 {"memory_bytes", p.totalGlobalMem},
                                 {"multiprocessors", p.multiProcessorCount},
                                 {"l2_bytes", p.l2CacheSize}});
  }
#endif
  if (cuda_device_count() == 0) j["cuda_unavailable"] = cuda_unavailable_reason();
  return j;
}

int configure_host_threads(int local_ranks, bool gpu) {
  if (local_ranks > 1) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    int share = std::max(1, cores / local_ranks);
    if (gpu) share = std::min(share, kGpuRankHostThreads);
    if (!std::getenv("OMP_NUM_THREADS")) omp_set_num_threads(share);
    if (!std::getenv("OPENBLAS_NUM_THREADS")) openblas_set_num_threads(share);
  }
  return omp_get_max_threads();
}

}  // namespace moecore
