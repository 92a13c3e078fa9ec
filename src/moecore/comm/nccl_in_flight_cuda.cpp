#include "moecore/comm/nccl_in_flight.h"

#include "moecore/core/cuda_check.h"

namespace moecore::comm {

NcclInFlight::NcclInFlight(ncclComm_t comm, int device, std::string group)
    : comm_(comm), device_(device), group_(std::move(group)) {
  watch_source(this);
}

NcclInFlight::~NcclInFlight() {
  unwatch_source(this);
  // An event still recorded is freed once it completes.
  for (void* e : queue_.release_all()) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

void NcclInFlight::set_group(std::string group) {
  std::lock_guard<std::mutex> lock(group_mutex_);
  group_ = std::move(group);
}

void NcclInFlight::issued(const char* collective, cudaStream_t stream) {
  cudaEvent_t e = static_cast<cudaEvent_t>(queue_.take());
  if (!e) MC_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const cudaError_t rc = cudaEventRecord(e, stream);
  if (rc != cudaSuccess) {
    queue_.give_back(e);
    MC_CUDA_CHECK(rc);
  }
  queue_.push(e, collective, InFlightQueue::Clock::now());
}

std::optional<WatchedSource::InFlight> NcclInFlight::oldest_in_flight() {
  if (!device_set_) device_set_ = cudaSetDevice(device_) == cudaSuccess;  // only the watchdog thread calls this
  // Anything but "not ready" ends the wait: done, or a CUDA error that the issuing thread reports.
  const auto finished = [](void* e) { return cudaEventQuery(static_cast<cudaEvent_t>(e)) != cudaErrorNotReady; };
  const std::optional<InFlightQueue::Oldest> oldest = queue_.oldest(InFlightQueue::Clock::now(), finished);
  if (!oldest) return std::nullopt;
  std::lock_guard<std::mutex> lock(group_mutex_);
  return InFlight{oldest->collective, group_, oldest->waited_s};
}

std::string NcclInFlight::async_error() {
  ncclResult_t result = ncclSuccess;
  if (ncclCommGetAsyncError(comm_, &result) != ncclSuccess) return "";
  if (result == ncclSuccess || result == ncclInProgress) return "";
  std::string group;
  {
    std::lock_guard<std::mutex> lock(group_mutex_);
    group = group_;
  }
  const char* detail = ncclGetLastError(comm_);
  return std::string("NCCL reported '") + ncclGetErrorString(result) + "' on " + group +
         (detail && *detail ? std::string(" (") + detail + ")" : std::string());
}

void NcclInFlight::abort() { ncclCommAbort(comm_); }

}  // namespace moecore::comm
