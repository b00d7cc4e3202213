// Small POSIX file-system helpers. The harness avoids std::filesystem on purpose: libtorch.so
// (PyPI wheel 2.11) exports its own copies of std::filesystem symbols, which the dynamic linker
// binds ahead of libstdc++'s, and at least std::filesystem::remove_all crashes (calls a null
// pointer) through them. These helpers use only libc. Also the one atomic file writer that run
// outputs and checkpoints use (library collider_base, linked by collider_models and collider_harness).
// Tests: tests/test_results.cpp, tests/test_write_failures.cpp.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace collider::fsutil {

// A write that failed (no space, file too large, read-only or forbidden directory). The message
// names the file and the errno text; a run ends on it (its rows and checkpoints stay whole).
struct WriteError : std::runtime_error {
  WriteError(const std::string& what, int error) : std::runtime_error(what), error_number(error) {}
  int error_number;  // errno of the failing call
};

bool exists(const std::string& path);
bool is_directory(const std::string& path);
// mkdir -p; throws std::runtime_error naming the path and errno text on failure.
void make_dirs(const std::string& path);
// Names (not paths) of the sub-directories of `dir`, sorted; empty when dir does not exist.
std::vector<std::string> list_subdirs(const std::string& dir);
// rename(2); throws on failure.
void rename_path(const std::string& from, const std::string& to);
// rm -rf (no error when missing); throws on failure.
void remove_tree(const std::string& path);
std::string join(const std::string& a, const std::string& b);
std::string read_file(const std::string& path);                     // "" when missing
void write_file(const std::string& path, const std::string& text);  // throws WriteError on failure

// Writes the pieces, in order, to a temporary name beside `path` (path.tmp.<pid>), fsyncs it,
// renames it over `path` and fsyncs the directory: a reader, or a process killed at any moment,
// sees the old file or the new one, never half of one. On failure the temporary file is removed,
// `path` is left as it was, and WriteError names `path` and the errno text.
void write_file_atomic(const std::string& path, std::initializer_list<std::string_view> pieces);
inline void write_file_atomic(const std::string& path, std::string_view bytes) { write_file_atomic(path, {bytes}); }
// fsync of a directory (after a rename in it); failures are ignored (not every file system can).
void sync_directory(const std::string& dir);
// The directory part of a path ("." when there is none).
std::string parent_dir(const std::string& path);

}  // namespace collider::fsutil
