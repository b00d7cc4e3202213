// The lock a run holds on the directory it writes (DIR/.lock): an flock, so that a second
// `collider run` on the same --out is refused before any compute instead of appending a second
// copy of every row, and so that a shared data directory's reference stage is computed once while
// other runs wait. The kernel drops an flock when its holder dies (even by kill -9), so a stale
// lock never blocks; the file's content (pid, host, start time) only names the holder in messages.
// Both run drivers (harness/recipes/sweep.cpp, harness/recipes/train_run.cpp) take it; in a data-parallel run only
// rank 0 writes, so only rank 0 locks. Tests: tests/test_run_lock.cpp.
#pragma once

#include <ostream>
#include <stdexcept>
#include <string>

namespace collider::harness {

// Another live process holds the lock; the message names it and says what to do.
struct RunDirBusy : std::runtime_error {
  explicit RunDirBusy(const std::string& what) : std::runtime_error(what) {}
};

class RunDirLock {
 public:
  RunDirLock() = default;
  // Takes the lock on DIR/.lock (creating DIR and the file). `what` names the holder's activity
  // in the record ("collider run"). Throws RunDirBusy when a live process holds it.
  static RunDirLock acquire(const std::string& dir, const std::string& what = "collider run");
  // The same, but waits for the holder to finish (one line on `log` when it has to wait).
  static RunDirLock acquire_waiting(const std::string& dir, std::ostream& log, const std::string& what);
  ~RunDirLock();
  RunDirLock(RunDirLock&& o) noexcept;
  RunDirLock& operator=(RunDirLock&& o) noexcept;
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  bool held() const { return fd_ >= 0; }
  void release();

 private:
  static RunDirLock take(const std::string& dir, const std::string& what, std::ostream* wait_log);
  int fd_ = -1;
};

// DIR/.lock's record: "pid P on HOST since TIME (WHAT)", or "" when absent.
std::string run_dir_lock_holder(const std::string& dir);

}  // namespace collider::harness
