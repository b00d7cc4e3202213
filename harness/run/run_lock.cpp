// Run-directory lock (run_lock.h).
#include "harness/run/run_lock.h"

#include "base/fsutil.h"
#include "harness/run/results.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <ctime>

namespace collider::harness {
namespace {

// The holder's record, or "" while it is not complete (it ends in a newline).
std::string read_record(int fd) {
  std::array<char, 512> buf{};
  const ssize_t n = ::pread(fd, buf.data(), buf.size() - 1, 0);
  std::string s(buf.data(), n > 0 ? static_cast<size_t>(n) : 0);
  if (s.empty() || s.back() != '\n') return "";
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s;
}

// A holder writes its record right after it takes the lock; one that has the lock but no record
// yet gets up to two seconds (a loaded machine), so that a refusal can name it.
std::string await_record(int fd) {
  std::string s = read_record(fd);
  for (int i = 0; s.empty() && i < 400; ++i) {
    ::usleep(5000);
    s = read_record(fd);
  }
  return s;
}

}  // namespace

RunDirLock RunDirLock::acquire(const std::string& dir, const std::string& what) { return take(dir, what, nullptr); }

RunDirLock RunDirLock::acquire_waiting(const std::string& dir, std::ostream& log, const std::string& what) {
  return take(dir, what, &log);
}

RunDirLock RunDirLock::take(const std::string& dir, const std::string& what, std::ostream* wait_log) {
  fsutil::make_dirs(dir);
  const std::string path = fsutil::join(dir, ".lock");
  // O_CLOEXEC: a child process (git, a shell) must not inherit the lock and outlive us with it.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int e = errno;
    throw fsutil::WriteError(fmt::format("cannot create the lock file '{}': {}", path, std::strerror(e)), e);
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    if (e != EWOULDBLOCK) {
      ::close(fd);
      throw std::runtime_error(fmt::format("cannot lock '{}': {}", path, std::strerror(e)));
    }
    std::string holder = await_record(fd);
    if (holder.empty()) holder = "a process that has not written its record yet";
    if (wait_log == nullptr) {
      ::close(fd);
      throw RunDirBusy(fmt::format(
          "{} is in use by another run ({}); it was not touched. Wait for that run to finish (or stop it), or pass "
          "another --out directory. The lock ({}) is released as soon as its holder exits, even when killed",
          dir, holder, path));
    }
    *wait_log << fmt::format("waiting for {} to be released ({})\n", path, holder) << std::flush;
    int r;
    while ((r = ::flock(fd, LOCK_EX)) != 0 && errno == EINTR) {}
    if (r != 0) {
      const int e2 = errno;
      ::close(fd);
      throw std::runtime_error(fmt::format("cannot lock '{}': {}", path, std::strerror(e2)));
    }
  }
  std::array<char, 256> host{};
  ::gethostname(host.data(), host.size() - 1);
  const std::string record =
      fmt::format("pid {} on {} since {} ({})\n", ::getpid(), host.data(), utc_timestamp(), what);
  // Informational only (the flock is the lock): a failure to write it does not stop the run.
  if (::ftruncate(fd, 0) == 0) { [[maybe_unused]] const ssize_t n = ::pwrite(fd, record.data(), record.size(), 0); }
  RunDirLock lock;
  lock.fd_ = fd;
  return lock;
}

RunDirLock::~RunDirLock() { release(); }

RunDirLock::RunDirLock(RunDirLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }

RunDirLock& RunDirLock::operator=(RunDirLock&& o) noexcept {
  if (this != &o) {
    release();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void RunDirLock::release() {
  if (fd_ >= 0) ::close(fd_);  // closing the only descriptor drops the flock
  fd_ = -1;
}

std::string run_dir_lock_holder(const std::string& dir) {
  const int fd = ::open(fsutil::join(dir, ".lock").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string s = read_record(fd);
  ::close(fd);
  return s;
}

}  // namespace collider::harness
