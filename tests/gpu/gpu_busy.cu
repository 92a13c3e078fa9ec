#include "gpu_busy.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "moecore/core/cuda_check.h"

namespace moecore::testing {
namespace {

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(uint64_t duration_ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < duration_ns) __nanosleep(1000);
}

}  // namespace

void hold_gpu(Device device, double milliseconds) {
  MC_CHECK(device.is_cuda() && milliseconds > 0, "hold_gpu: a CUDA device and a positive time are needed");
  set_current_device(device);
  const auto stream = static_cast<cudaStream_t>(current_stream(device).handle());
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(milliseconds * 1e6));
  MC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moecore::testing
