#include "moecore/train/save_dir_guard.h"

#include <fcntl.h>
#include <sys/file.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moecore/core/error.h"

namespace fs = std::filesystem;

namespace moecore {

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "unknown-host";
  return buf;
}

bool process_alive(long pid) {
  if (pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

namespace {
// Creates dir; the error names the flag and the reason.
// subject: what the flag names when it is not the directory itself ("" when it is).
void create_dir(const std::string& dir, const std::string& flag, const std::string& subject = "") {
  std::error_code ec;
  fs::create_directories(dir, ec);
  const std::string what = subject.empty() ? flag + " '" + dir + "': cannot create the directory"
                                           : flag + " '" + subject + "': cannot create its directory '" + dir + "'";
  MC_CHECK(!ec, what, ": ", ec.message());
  MC_CHECK(fs::is_directory(dir, ec), what, ": not a directory");
}

// "host=H pid=P" of a lock file's text; empty fields when it holds none.
void parse_holder(const std::string& text, std::string* host, long* pid) {
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    if (word.rfind("host=", 0) == 0) *host = word.substr(5);
    if (word.rfind("pid=", 0) == 0) *pid = std::atol(word.c_str() + 4);
  }
}

std::string read_all(int fd) {
  std::string text;
  char buf[512];
  ::lseek(fd, 0, SEEK_SET);
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) text.append(buf, static_cast<size_t>(n));
  return text;
}
}  // namespace

SaveDirLock::SaveDirLock(const std::string& dir) {
  create_dir(dir, "--save");
  path_ = (fs::path(dir) / kSaveLockFile).string();
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  MC_CHECK(fd_ >= 0, "--save '", dir, "': cannot create the lock file '", path_, "': ", std::strerror(errno));
  const std::string previous = read_all(fd_);
  std::string host;
  long pid = 0;
  parse_holder(previous, &host, &pid);
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    MC_CHECK(err == EWOULDBLOCK, "--save '", dir, "': cannot lock '", path_, "': ", std::strerror(err));
    MC_FAIL("--save '", dir, "' is in use by another run (", host.empty() ? "unknown host" : "host " + host, ", pid ",
            pid, "; lock file '", path_, "'): two runs must not write one save directory; give this run another "
            "--save, or wait for that one to end");
  }
  if (pid > 0) {  // the flock was free: whoever wrote the file has ended (or lost it with its host)
    const bool here = host == host_name();
    std::printf("note: --save %s: taking over the lock left by pid %ld on %s (%s)\n", dir.c_str(), pid,
                host.empty() ? "an unknown host" : host.c_str(),
                here ? (process_alive(pid) ? "the lock is free" : "that process is gone") : "the lock is free");
  }
  const std::string mine = "host=" + host_name() + " pid=" + std::to_string(getpid()) + "\n";
  const bool ok = ::ftruncate(fd_, 0) == 0 && ::pwrite(fd_, mine.data(), mine.size(), 0) == static_cast<ssize_t>(mine.size());
  MC_CHECK(ok, "--save '", dir, "': cannot write the lock file '", path_, "': ", std::strerror(errno));
}

SaveDirLock::~SaveDirLock() {
  if (fd_ < 0) return;
  // Empty the file before unlocking, so that no later run reads this (ended) process as a holder.
  if (::ftruncate(fd_, 0) != 0) {
  }
  ::flock(fd_, LOCK_UN);
  ::close(fd_);
}

void probe_writable_dir(const std::string& dir, const std::string& flag) {
  create_dir(dir, flag);
  const fs::path probe = fs::path(dir) / (".moecore-write-probe-" + std::to_string(getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = errno;
  bool ok = fd >= 0 && ::write(fd, "x", 1) == 1;
  const int write_err = errno;
  if (fd >= 0) ok = ::close(fd) == 0 && ok;
  ::unlink(probe.c_str());
  MC_CHECK(fd >= 0, flag, " '", dir, "': cannot write in the directory: ", std::strerror(err));
  MC_CHECK(ok, flag, " '", dir, "': writing a file in the directory failed: ", std::strerror(write_err));
}

void probe_writable_file(const std::string& file, const std::string& flag) {
  const fs::path parent = fs::path(file).parent_path();
  if (!parent.empty()) create_dir(parent.string(), flag, file);
  std::error_code ec;
  MC_CHECK(!fs::is_directory(file, ec), flag, " '", file, "': is a directory; expected a file");
  const bool existed = fs::exists(file, ec);
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const int err = errno;
  if (fd >= 0) ::close(fd);
  MC_CHECK(fd >= 0, flag, " '", file, "': cannot open it for writing: ", std::strerror(err));
  if (!existed) ::unlink(file.c_str());
}

}  // namespace moecore
