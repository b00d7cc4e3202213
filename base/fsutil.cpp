// POSIX file-system helpers (fsutil.h).
#include "base/fsutil.h"

#include "base/fault.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace collider::fsutil {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_dirs(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty() || is_directory(cur)) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
      throw std::runtime_error("cannot create directory '" + cur + "': " + std::strerror(errno));
    }
  }
}

std::vector<std::string> list_subdirs(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    if (is_directory(join(dir, name))) out.push_back(name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    throw std::runtime_error("cannot rename '" + from + "' to '" + to + "': " + std::strerror(errno));
  }
}

namespace {
int remove_entry(const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }
}  // namespace

void remove_tree(const std::string& path) {
  if (!exists(path)) return;
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    throw std::runtime_error("cannot remove '" + path + "': " + std::strerror(errno));
  }
}

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  return a.back() == '/' ? a + b : a + "/" + b;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int e = errno;
    throw WriteError("cannot write '" + path + "': " + std::strerror(e), e);
  }
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : ENOSPC;
      ::close(fd);
      throw WriteError("cannot write '" + path + "': " + std::strerror(e), e);
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    const int e = errno;
    throw WriteError("cannot write '" + path + "': " + std::strerror(e), e);
  }
}

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void write_file_atomic(const std::string& path, std::initializer_list<std::string_view> pieces) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  auto fail = [&](int e, int fd) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw WriteError(std::string("cannot write '") + path + "': " + std::strerror(e) + " (while writing '" + tmp +
                         "'; the previous version of the file, if any, is unchanged)",
                     e);
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(errno, -1);
  size_t total = 0, written = 0;
  for (auto p : pieces) total += p.size();
  // Tests (COLLIDER_FAULT_AT names the current fault::Scope): stop half-way through the temporary file.
  const char* scope = fault::current_scope();
  if (scope != nullptr && !fault::armed(scope)) scope = nullptr;
  for (auto p : pieces) {
    size_t done = 0;
    while (done < p.size()) {
      size_t chunk = p.size() - done;
      if (scope != nullptr && written < total / 2 && written + chunk > total / 2) chunk = total / 2 - written;
      const ssize_t n = ::write(fd, p.data() + done, chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail(n < 0 ? errno : ENOSPC, fd);
      done += static_cast<size_t>(n);
      written += static_cast<size_t>(n);
      if (scope != nullptr && written == total / 2) fault::hit(scope);
    }
  }
  if (::fsync(fd) != 0) fail(errno, fd);
  if (::close(fd) != 0) fail(errno, -1);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail(errno, -1);
  sync_directory(parent_dir(path));
}

}  // namespace collider::fsutil
