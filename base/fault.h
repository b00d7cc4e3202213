// Fault injection for the reliability tests: COLLIDER_FAULT_AT=<point>[:<n>] makes the process
// kill itself with SIGKILL at the n-th time (default 1) it reaches the named point, so a test can
// stop a run exactly inside a write instead of hoping a timed kill lands there. Points:
//   checkpoint_write  half-way through writing a file of a training checkpoint (temporary name)
//   checkpoint_swap   between moving the old checkpoint aside and renaming the new one in
//   row_append        half-way through appending a results.jsonl row (leaves a torn line)
// COLLIDER_FAULT_HOLD=<point>:<file> makes the process wait at the named point until <file> exists
// (at most 300 s), so a test can make two processes meet there without depending on timing:
//   run_locked        a run has taken its output directory's lock (harness/run/run_dir.cpp)
// Unset (the normal case) every call is one comparison. Tests: tests/test_fault_injection_slow.cpp,
// tests/test_run_lock.cpp.
#pragma once

namespace collider::fault {

// Whether COLLIDER_FAULT_AT names `point` (a writer may then split a write to stop inside it).
bool armed(const char* point);
// Counts a hit of `point`; raises SIGKILL when COLLIDER_FAULT_AT names it and this is the n-th hit.
void hit(const char* point);
// Waits at `point` while COLLIDER_FAULT_HOLD names it and its file does not exist yet.
void hold(const char* point);

// Names the kind of write in progress on this thread (e.g. "checkpoint_write"), so that the shared
// file writer (fsutil::write_file_atomic) can stop half-way through that kind only.
class Scope {
 public:
  explicit Scope(const char* point);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* previous_;
};
// The innermost Scope's point on this thread, or nullptr.
const char* current_scope();

}  // namespace collider::fault
