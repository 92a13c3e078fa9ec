// A watchdog for stuck collectives (Megatron's --distributed-timeout-minutes): once
// set_collective_timeout() is called, a thread checks the waits that WatchedWait marks; when one
// lasts longer than the timeout it prints one line naming the rank, the collective and the group
// and ends the process (exit status 1), which ends the launcher's job and so every rank, a stopped
// one too. The MPI backend marks each of its blocking waits.
#pragma once

#include <string>

namespace moecore::comm {

// seconds > 0 starts the watchdog (once per process); a later call changes the timeout.
void set_collective_timeout(double seconds, int world_rank);

// Marks the calling thread as waiting in `collective` on `group` from now until destruction.
class WatchedWait {
 public:
  WatchedWait(const char* collective, const std::string& group);
  ~WatchedWait();
  WatchedWait(const WatchedWait&) = delete;
  WatchedWait& operator=(const WatchedWait&) = delete;
};

}  // namespace moecore::comm
