// A watchdog for stuck collectives (Megatron's --distributed-timeout-minutes): once
// set_collective_timeout() is called, a thread checks every 200 ms
//  * the waits that WatchedWait marks (the MPI backend marks each of its blocking waits), and
//  * the watched sources (WatchedSource: the NCCL communicators, whose collectives run on the
//    device after the call returned): the oldest collective still in flight and any error the
//    backend reported asynchronously.
// When a wait or an in-flight collective lasts longer than the timeout, or a source reports an
// error, it prints one line naming the rank, the collective, the group and the flag, aborts every
// watched source (ncclCommAbort; at most 10 s, so an abort that hangs too cannot keep the job
// alive) and ends the process (exit status 1), which ends the launcher's job and so every rank, a
// stopped one too.
#pragma once

#include <optional>
#include <string>

namespace moecore::comm {

// seconds > 0 starts the watchdog (once per process); a later call changes the timeout.
void set_collective_timeout(double seconds, int world_rank);
// Whether set_collective_timeout started the watchdog (communicators created afterwards register).
bool collective_watchdog_started();

// Marks the calling thread as waiting in `collective` on `group` from now until destruction.
class WatchedWait {
 public:
  WatchedWait(const char* collective, const std::string& group);
  ~WatchedWait();
  WatchedWait(const WatchedWait&) = delete;
  WatchedWait& operator=(const WatchedWait&) = delete;
};

// Work the watchdog polls from its own thread (the methods must be safe to call from it).
class WatchedSource {
 public:
  struct InFlight {
    std::string collective;  // "all_reduce", "a group of collectives", ...
    std::string group;       // "the dp group of world ranks 0,1"
    double waited_s = 0;     // since it was issued
  };
  virtual ~WatchedSource() = default;
  // The oldest operation not finished yet (nullopt: none).
  virtual std::optional<InFlight> oldest_in_flight() = 0;
  // An error the backend reported asynchronously, as a sentence naming the group ("": none).
  virtual std::string async_error() = 0;
  // Ends the source's communication so that nothing stays blocked in it; called once, just
  // before the process ends.
  virtual void abort() = 0;
};
// Registers / unregisters a source (unwatch_source returns after any check of it has finished).
void watch_source(WatchedSource* source);
void unwatch_source(WatchedSource* source);

// One pass of the watchdog's checks against `timeout_s` (the thread runs it; tests call it with
// fake sources): the error line for the first wait or source found stuck or failed, "" if none.
std::string check_collectives(double timeout_s, int world_rank);

}  // namespace moecore::comm
