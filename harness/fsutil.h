// Small POSIX file-system helpers. The harness avoids std::filesystem on purpose: libtorch.so
// (PyPI wheel 2.11) exports its own copies of std::filesystem symbols, which the dynamic linker
// binds ahead of libstdc++'s, and at least std::filesystem::remove_all crashes (calls a null
// pointer) through them. These helpers use only libc.
// Tests: tests/test_results.cpp.
#pragma once

#include <string>
#include <vector>

namespace collider::harness::fsutil {

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
std::string read_file(const std::string& path);  // "" when missing
void write_file(const std::string& path, const std::string& text);  // throws on failure

}  // namespace collider::harness::fsutil
