// The NCCL collectives of one communicator still running on the device, for the collective
// watchdog (collective_watchdog.h; --distributed-timeout-minutes). CUDA backend only.
//
// Hot path (the thread issuing collectives): issued() records one CUDA event on the collective's
// stream right behind it, taken from a pool of reusable events (InFlightQueue: created once, never
// per call); no host synchronisation. Watchdog thread: oldest_in_flight() queries the events in
// issue order (cudaEventQuery), returns the finished ones to the pool and reports the oldest unfinished one
// with the time since it was issued (queued work ahead of it on the stream counts too; the
// timeout is meant to be minutes); async_error() asks ncclCommGetAsyncError; abort() is
// ncclCommAbort, after which the process ends.
#pragma once

#if MOECORE_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <mutex>
#include <string>

#include "moecore/comm/collective_watchdog.h"
#include "moecore/comm/in_flight_queue.h"

namespace moecore::comm {

class NcclInFlight final : public WatchedSource {
 public:
  // Registers with the watchdog; `group` names the communicator in messages.
  NcclInFlight(ncclComm_t comm, int device, std::string group);
  ~NcclInFlight() override;  // unregisters, then frees the events
  NcclInFlight(const NcclInFlight&) = delete;
  NcclInFlight& operator=(const NcclInFlight&) = delete;

  void set_group(std::string group);
  // `collective` ("all_reduce", ...) was just enqueued on `stream`.
  void issued(const char* collective, cudaStream_t stream);

  std::optional<InFlight> oldest_in_flight() override;
  std::string async_error() override;
  void abort() override;

 private:
  ncclComm_t comm_;
  int device_;
  InFlightQueue queue_;       // markers: cudaEvent_t
  std::mutex group_mutex_;    // guards group_ (renamed by the issuing thread, read by the watchdog)
  std::string group_;
  bool device_set_ = false;   // the watchdog thread's current device is device_
};

}  // namespace moecore::comm
#endif
