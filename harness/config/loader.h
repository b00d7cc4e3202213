// The one TOML loader of every manifest: key lookup, type checks, where each value came from,
// --set overrides, unknown-key detection and the value checks of a validator. A schema declares
// its keys, each bound to a field with its built-in default already in it, then applies the file
// and the --set overrides in that order (nanoGPT's configurator: defaults, file, --key=value;
// every override echoed) and validates with check_in / check / check_unique, whose messages
// name the file or the --set that gave the value, the key, the value and what is allowed.
// Schemas: timing sweeps (manifest.cpp), training runs (train_manifest.cpp).
// Tests: tests/test_manifest.cpp, tests/test_utility.cpp, tests/test_fuzz_regressions.cpp.
#pragma once

#include <toml++/toml.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace collider::harness {

// Every problem of a manifest: raised at load, before any compute.
class ManifestError : public std::runtime_error {
 public:
  explicit ManifestError(const std::string& what) : std::runtime_error(what) {}
};

// The file's text (ManifestError "cannot open the manifest" when it cannot be read).
std::string read_manifest_file(const std::string& path);
// The text as TOML; a syntax error is a ManifestError "NAME:LINE:COLUMN: not valid TOML: ...".
toml::table parse_manifest_toml(const std::string& text, const std::string& source_name);
// The value of a `--set key=value`, in a table under "v": the text in TOML syntax ([64, 128],
// 0.4, true, "x"), or, when it does not parse as TOML, the bare word as a string.
toml::table parse_set_value(const std::string& text);
// A node's TOML type as the messages name it: "a string", "an integer", "a table", ...
std::string toml_type_name(const toml::node& n);

class Loader {
 public:
  // A top-level key the schema reads itself (timing manifests' [[exclude]] array of tables):
  // called with the node and the place it came from.
  using CustomReader = std::function<void(const toml::node&, const std::string& where)>;

  // `path` names the file in every message; `set_example` is the --set of the key=value hint.
  Loader(std::string path, std::string set_example);

  // ---- the schema --------------------------------------------------------------------------
  // A table ([run]); `example_key` is the key of the "set one key at a time" hint.
  void add_section(const std::string& name, const std::string& example_key);
  // A key, "name" (top level) or "run.seed" (in a declared section), bound to a field. Lists take
  // a scalar or a non-empty array. Keys not advertised are accepted but left out of the lists of
  // allowed keys in messages (test hooks).
  template <class T>
  void add(const std::string& key, T* field, bool advertised = true) {
    declare(key, Field(field), advertised);
  }
  // A top-level key read by `reader`; `set_refusal` is the message for a --set of it.
  void add_custom(const std::string& key, CustomReader reader, std::string set_refusal);

  // ---- values ------------------------------------------------------------------------------
  // The file's keys, then each --set "key=value". A --set into a table that the file wrote as
  // something else is refused before the file is read.
  void apply(const toml::table& root, const std::vector<std::string>& sets);
  // Whether the file or a --set gave `key` (false: its built-in default stands).
  bool given(const std::string& key) const { return sources_.count(key) > 0; }
  // Where `key`'s value came from: "built-in default", the file, or "FILE: --set '...'".
  const std::string& source(const std::string& key) const;
  // One echo line per --set: "override KEY = NEW (was OLD; from --set)".
  const std::vector<std::string>& overrides() const { return overrides_; }
  const std::string& path() const { return path_; }
  // Every advertised key's value as it is now (after apply, and after the schema resolved any,
  // such as device "auto"): the top-level keys and one table per section, in TOML types. What a
  // run saves as its resolved manifest; keys not advertised (test hooks) and custom keys
  // ([[exclude]]) are the schema's to add.
  toml::table resolved_table() const;

  // ---- typed reads (type errors name `where` and `key`) ------------------------------------
  std::string get_string(const toml::node& n, const std::string& key, const std::string& where) const;
  int64_t get_int(const toml::node& n, const std::string& key, const std::string& where) const;
  double get_float(const toml::node& n, const std::string& key, const std::string& where) const;
  bool get_bool(const toml::node& n, const std::string& key, const std::string& where) const;
  // A scalar or a non-empty array; element i is read as KEY[i].
  template <class T>
  std::vector<T> get_list(const toml::node& n, const std::string& key, const std::string& where) const {
    std::vector<T> out;
    if (const auto* arr = n.as_array()) {
      if (arr->empty()) fail(where, key, "must not be an empty array");
      for (size_t i = 0; i < arr->size(); ++i) {
        out.push_back(get<T>(*arr->get(i), key + "[" + std::to_string(i) + "]", where));
      }
    } else {
      out.push_back(get<T>(n, key, where));
    }
    return out;
  }
  template <class T>
  T get(const toml::node& n, const std::string& key, const std::string& where) const {
    if constexpr (std::is_same_v<T, std::string>)
      return get_string(n, key, where);
    else if constexpr (std::is_same_v<T, int64_t>)
      return get_int(n, key, where);
    else if constexpr (std::is_same_v<T, double>)
      return get_float(n, key, where);
    else
      return get_bool(n, key, where);
  }

  // ---- the validator's checks (they name the key's source) --------------------------------
  [[noreturn]] void fail(const std::string& where, const std::string& key, const std::string& what) const;
  // `value` is one of `allowed`: "KEY = "VALUE" is not allowed; allowed: A, B".
  void check_in(const std::string& key, const std::string& value, const std::vector<std::string>& allowed) const;
  // check_in, then the value parsed by `parse` (one of the name parsers of models/method.h).
  template <class E>
  E parse_in(const std::string& key, const std::string& value, const std::vector<std::string>& allowed,
             E (*parse)(const std::string&)) const {
    check_in(key, value, allowed);
    return parse(value);
  }
  // "KEY = VALUE is out of range; allowed: ALLOWED" unless ok.
  void check(bool ok, const std::string& key, const std::string& value, const std::string& allowed) const;
  template <class T>
  void check_unique(const std::string& key, const std::vector<T>& v) const {
    if (std::set<T>(v.begin(), v.end()).size() != v.size()) fail_unique(key);
  }

 private:
  using Field = std::variant<std::string*, int64_t*, double*, bool*, std::vector<std::string>*, std::vector<int64_t>*,
                             std::vector<double>*>;
  struct Key {
    Field field;
    bool advertised;
  };
  void declare(const std::string& key, Field field, bool advertised);
  static void put(toml::table& table, const std::string& name, const Field& field);  // resolved_table
  void apply_key(const std::string& key, const toml::node& n, const std::string& where);
  void apply_set(const std::string& arg);
  [[noreturn]] void fail_unknown(const std::string& key, const toml::node& n, const std::string& where) const;
  [[noreturn]] void fail_unique(const std::string& key) const;
  std::string describe_current(const std::string& key) const;

  std::string path_, set_example_;
  std::vector<std::string> top_keys_;  // declaration order: keys, sections, custom keys
  std::vector<std::string> sections_;  // in declaration order
  std::map<std::string, std::string> section_example_;
  std::map<std::string, std::vector<std::string>> section_keys_;  // advertised keys of each section
  std::map<std::string, Key> keys_;
  std::map<std::string, std::pair<CustomReader, std::string>> custom_;
  std::map<std::string, std::string> sources_, current_;
  std::vector<std::string> overrides_;
};

}  // namespace collider::harness
