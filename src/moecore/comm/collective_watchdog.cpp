#include "moecore/comm/collective_watchdog.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace moecore::comm {

namespace {
using Clock = std::chrono::steady_clock;

struct Watch {
  std::mutex mutex;
  bool waiting = false;
  const char* collective = "";
  std::string group;
  Clock::time_point since;
  std::vector<WatchedSource*> sources;
  std::atomic<double> timeout_s{0};
  int rank = 0;
  std::atomic<bool> started{false};  // read without the lock by every wait
};

Watch& watch() {
  static Watch* w = new Watch;  // never destroyed: the thread may outlive static destruction
  return *w;
}

std::string timeout_line(int rank, const std::string& collective, const std::string& group, double waited,
                         double limit) {
  char text[160];
  std::snprintf(text, sizeof text, " waited %.1f s, more than --distributed-timeout-minutes %g: ", waited,
                limit / 60.0);
  return "moecore: error: rank " + std::to_string(rank) + ": " + collective + " on " + group + text +
         "another rank is stuck, stopped or gone; ending the job";
}

// Aborts every watched source and ends the process. A thread of its own does it, holding the lock
// (so no source is destroyed meanwhile) and ending the process itself (so no thread unblocked by an
// abort goes on); an abort that hangs too (a broken network) is given 10 s.
[[noreturn]] void abort_sources_and_exit() {
  std::thread([] {
    Watch& w = watch();
    std::lock_guard<std::mutex> lock(w.mutex);
    for (WatchedSource* s : w.sources) s->abort();
    std::_Exit(1);
  }).detach();
  std::this_thread::sleep_for(std::chrono::seconds(10));
  std::_Exit(1);
}

void run_watchdog() {
  Watch& w = watch();
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const std::string error = check_collectives(w.timeout_s.load(), w.rank);
    if (error.empty()) continue;
    std::fprintf(stderr, "%s\n", error.c_str());
    std::fflush(stderr);
    std::fflush(stdout);
    abort_sources_and_exit();
  }
}
}  // namespace

std::string check_collectives(double timeout_s, int world_rank) {
  Watch& w = watch();
  std::lock_guard<std::mutex> lock(w.mutex);
  for (WatchedSource* s : w.sources) {
    const std::string error = s->async_error();
    if (!error.empty())
      return "moecore: error: rank " + std::to_string(world_rank) + ": " + error +
             " (reported while --distributed-timeout-minutes watches the collectives); ending the job";
  }
  if (timeout_s <= 0) return "";
  if (w.waiting) {
    const double waited = std::chrono::duration<double>(Clock::now() - w.since).count();
    if (waited > timeout_s) return timeout_line(world_rank, w.collective, w.group, waited, timeout_s);
  }
  for (WatchedSource* s : w.sources) {
    const std::optional<WatchedSource::InFlight> oldest = s->oldest_in_flight();
    if (oldest && oldest->waited_s > timeout_s)
      return timeout_line(world_rank, oldest->collective, oldest->group, oldest->waited_s, timeout_s);
  }
  return "";
}

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

bool collective_watchdog_started() { return watch().started.load(); }

void watch_source(WatchedSource* source) {
  Watch& w = watch();
  std::lock_guard<std::mutex> lock(w.mutex);
  w.sources.push_back(source);
}

void unwatch_source(WatchedSource* source) {
  Watch& w = watch();
  std::lock_guard<std::mutex> lock(w.mutex);
  w.sources.erase(std::remove(w.sources.begin(), w.sources.end(), source), w.sources.end());
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
