// A scratch directory for harness tests, removed with its contents on destruction (kept when
// COLLIDER_KEEP_TEST_DIRS is set, to read a failed test's logs).
// POSIX calls via base/fsutil.h (libtorch.so's std::filesystem::remove_all crashes).
#pragma once

#include "base/fsutil.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace collider::testing {

struct TempDir {
  std::string path;
  // prefix names the test, e.g. "sweep" -> /tmp/collider_test_sweep_<pid>_<n>
  explicit TempDir(const std::string& prefix) {
    static int counter = 0;
    path = "/tmp/collider_test_" + prefix + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
    fsutil::remove_tree(path);
    fsutil::make_dirs(path);
  }
  ~TempDir() {
    if (!std::getenv("COLLIDER_KEEP_TEST_DIRS")) fsutil::remove_tree(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return fsutil::join(path, name); }
};

}  // namespace collider::testing
