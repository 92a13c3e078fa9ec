// The bookkeeping of collectives issued to a device and not yet seen finished, for the collective
// watchdog (collective_watchdog.h): oldest first, each with a completion marker (for NCCL a CUDA
// event; opaque here, so the logic is tested on the CPU with fake markers) and the time it was
// issued. Finished markers go to a pool and are handed out again, so the issuing path allocates
// nothing once the pool holds as many markers as there are collectives in flight at most.
// Thread-safe: the issuing thread calls take/push, the watchdog thread oldest().
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

namespace moecore::comm {

class InFlightQueue {
 public:
  using Clock = std::chrono::steady_clock;
  struct Oldest {
    const char* collective;
    double waited_s;
  };

  // A pooled marker, or nullptr when the pool is empty (the caller makes a new one).
  void* take();
  // Back to the pool unused (its recording failed).
  void give_back(void* marker);
  // `marker` completes once `collective`, issued at `at`, has finished.
  void push(void* marker, const char* collective, Clock::time_point at);
  // Drops the finished collectives in issue order (finished(marker) says; their markers go to the
  // pool) up to the first unfinished one, which it returns with its age at `now`; nullopt when
  // every collective has finished.
  std::optional<Oldest> oldest(Clock::time_point now, const std::function<bool(void*)>& finished);
  // Every marker, pooled or in flight (to free them), leaving the queue empty.
  std::vector<void*> release_all();
  size_t pooled() const;
  size_t in_flight() const;

 private:
  struct Issued {
    void* marker;
    const char* collective;
    Clock::time_point at;
  };
  mutable std::mutex mutex_;
  std::deque<Issued> issued_;
  std::vector<void*> pool_;
};

}  // namespace moecore::comm
