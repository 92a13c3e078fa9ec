#include "moecore/comm/collective_watchdog.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace moecore::comm {

namespace {
using Clock = std::chrono::steady_clock;

struct Watch {
  std::mutex mutex;
  bool waiting = false;
  const char* collective = "";
  std::string group;
  Clock::time_point since;
  std::atomic<double> timeout_s{0};
  int rank = 0;
  std::atomic<bool> started{false};  // read without the lock by every wait
};

Watch& watch() {
  static Watch* w = new Watch;  // never destroyed: the thread may outlive static destruction
  return *w;
}

void run_watchdog() {
  Watch& w = watch();
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::lock_guard<std::mutex> lock(w.mutex);
    if (!w.waiting) continue;
    const double waited = std::chrono::duration<double>(Clock::now() - w.since).count();
    const double limit = w.timeout_s.load();
    if (limit <= 0 || waited <= limit) continue;
    std::fprintf(stderr,
                 "moecore: error: rank %d: %s on %s waited %.1f s, more than --distributed-timeout-minutes %g: "
                 "another rank is stuck, stopped or gone; ending the job\n",
                 w.rank, w.collective, w.group.c_str(), waited, limit / 60.0);
    std::fflush(stderr);
    std::fflush(stdout);
    std::_Exit(1);
  }
}
}  // namespace

void set_collective_timeout(double seconds, int world_rank) {
  Watch& w = watch();
  std::lock_guard<std::mutex> lock(w.mutex);
  w.timeout_s = seconds;
  w.rank = world_rank;
  if (seconds > 0 && !w.started) {
    w.started = true;
    std::thread(run_watchdog).detach();
  }
}

WatchedWait::WatchedWait(const char* collective, const std::string& group) {
  Watch& w = watch();
  if (!w.started) return;
  std::lock_guard<std::mutex> lock(w.mutex);
  w.waiting = true;
  w.collective = collective;
  w.group = group;
  w.since = Clock::now();
}

WatchedWait::~WatchedWait() {
  Watch& w = watch();
  if (!w.started) return;
  std::lock_guard<std::mutex> lock(w.mutex);
  w.waiting = false;
}

}  // namespace moecore::comm
