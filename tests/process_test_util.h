// Child processes for the reliability tests (run lock, write failures, fault injection): start
// build/collider or a script with extra environment variables, its output in a file, optionally
// under a file size limit (RLIMIT_FSIZE with SIGXFSZ ignored, so write(2) fails with EFBIG as on
// a full disk); wait for it, or kill it with SIGKILL. fork + exec, with only async-signal-safe
// calls between them (the test process runs libtorch's threads).
#pragma once

#include "base/fsutil.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace collider::testing {

inline std::string collider_bin() { return std::string(COLLIDER_BINARY_DIR) + "/collider"; }

struct ChildOptions {
  std::vector<std::string> env;  // extra NAME=VALUE entries (they win over the inherited ones)
  std::string log_path;          // stdout and stderr go here (appended); empty: /dev/null
  long file_size_limit = -1;     // bytes (RLIMIT_FSIZE); -1: none
};

class Child {
 public:
  Child(const std::vector<std::string>& argv, const ChildOptions& o = {}) {
    std::vector<std::string> env_s;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      bool overridden = false;
      for (const auto& x : o.env)
        overridden = overridden || kv.substr(0, kv.find('=') + 1) == x.substr(0, x.find('=') + 1);
      if (!overridden) env_s.push_back(kv);
    }
    env_s.insert(env_s.end(), o.env.begin(), o.env.end());
    std::vector<std::string> argv_s = argv;
    std::vector<char*> av, ev;
    for (auto& a : argv_s) av.push_back(a.data());
    av.push_back(nullptr);
    for (auto& e : env_s) ev.push_back(e.data());
    ev.push_back(nullptr);
    const std::string log = o.log_path.empty() ? "/dev/null" : o.log_path;
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
      }
      if (o.file_size_limit >= 0) {
        ::signal(SIGXFSZ, SIG_IGN);
        struct rlimit rl {
          static_cast<rlim_t>(o.file_size_limit), static_cast<rlim_t>(o.file_size_limit)
        };
        ::setrlimit(RLIMIT_FSIZE, &rl);
      }
      ::execve(av[0], av.data(), ev.data());
      ::_exit(127);
    }
  }
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      wait();
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  // Waits for the child; returns its exit status, or 128 + signal when a signal ended it.
  int wait() {
    if (reaped_) return status_;
    int st = 0;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {}
    reaped_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return status_;
  }
  // True (and the status in *status) once the child has ended; never blocks.
  bool done(int* status) {
    if (reaped_) {
      *status = status_;
      return true;
    }
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) != pid_) return false;
    reaped_ = true;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    *status = status_;
    return true;
  }
  // SIGKILL, then reap; returns the status (128 + 9 when the kill ended it).
  int kill9() {
    if (!reaped_) ::kill(pid_, SIGKILL);
    return wait();
  }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = -1;
};

// Runs argv to completion; returns its exit status (128 + signal when killed).
inline int run_child(const std::vector<std::string>& argv, const ChildOptions& o = {}) { return Child(argv, o).wait(); }

}  // namespace collider::testing
