// Guards of a run's output paths, taken before any work (before the model is built):
//   SaveDirLock     an advisory lock (flock) on <save>/.moecore.lock, held for the whole run by the
//                   rank that writes checkpoints; the file names the holder (host and pid), so a
//                   second run on the same --save is refused with a message naming them. A lock
//                   file left by a process that is gone (the flock is free) is taken over with a note.
//   probe_writable_dir / probe_writable_file
//                   create a directory (or a file's parent) and write a probe file in it, so an
//                   unwritable path fails at once naming its flag instead of after the training.
#pragma once

#include <string>

namespace moecore {

class SaveDirLock {
 public:
  // dir: the --save directory (created if absent). Throws Error when another live process holds it.
  explicit SaveDirLock(const std::string& dir);
  ~SaveDirLock();
  SaveDirLock(const SaveDirLock&) = delete;
  SaveDirLock& operator=(const SaveDirLock&) = delete;

 private:
  std::string path_;
  int fd_ = -1;
};

// The lock file's name inside a save directory.
inline constexpr const char* kSaveLockFile = ".moecore.lock";

// Creates `dir` (flag: e.g. "--save") and checks that a file can be written in it.
void probe_writable_dir(const std::string& dir, const std::string& flag);
// Creates the parent of `file` and checks that `file` can be opened for appending (it is not
// truncated; a file that did not exist is removed again).
void probe_writable_file(const std::string& file, const std::string& flag);

// This machine's host name ("unknown-host" when it cannot be read).
std::string host_name();
// True when a process with this id runs on this machine (or exists but belongs to someone else).
bool process_alive(long pid);

}  // namespace moecore
