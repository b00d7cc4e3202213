// The value of a `--set key=value` override, shared by timing manifests (manifest.cpp) and
// training manifests (train_run.cpp): the text in TOML syntax ([64, 128], 0.4, true, "x"), or,
// when it does not parse as TOML, the bare word as a string. Tests: tests/test_manifest.cpp,
// tests/test_utility.cpp (overrides of both kinds of manifest).
#pragma once

#include <toml++/toml.h>

#include <string>

namespace collider::harness {

// A table whose key "v" holds the value.
inline toml::table parse_set_value(const std::string& text) {
  try {
    toml::table parsed = toml::parse("v = " + text);
    if (parsed.contains("v")) return parsed;
  } catch (const toml::parse_error&) {
  }
  return toml::table{{"v", text}};
}

}  // namespace collider::harness
