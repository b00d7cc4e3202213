// The manifest loader (loader.h): declared keys bound to fields, the file then the --set
// overrides, each key remembering where its value came from so that an error names the file
// (and the --set) at fault.
#include "harness/config/loader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <sstream>

namespace collider::harness {
namespace {

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  return fmt::format("{}", fmt::join(v, sep));
}

}  // namespace

std::string toml_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::table:
      return "a table";
    default:
      return "a date/time";
  }
}

namespace {

std::string render(const toml::node& n) {
  std::ostringstream os;
  n.visit([&](const auto& v) { os << v; });
  return os.str();
}

std::string section_of(const std::string& key) {
  const auto dot = key.find('.');
  return dot == std::string::npos ? std::string() : key.substr(0, dot);
}

}  // namespace

std::string read_manifest_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ManifestError(fmt::format("{}: cannot open the manifest (no such file or not readable)", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

toml::table parse_manifest_toml(const std::string& text, const std::string& source_name) {
  try {
    return toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    throw ManifestError(fmt::format("{}:{}:{}: not valid TOML: {}", source_name, e.source().begin.line,
                                    e.source().begin.column, e.description()));
  }
}

toml::table parse_set_value(const std::string& text) {
  try {
    toml::table parsed = toml::parse("v = " + text);
    if (parsed.contains("v")) return parsed;
  } catch (const toml::parse_error&) {}
  return toml::table{{"v", text}};
}

Loader::Loader(std::string path, std::string set_example)
    : path_(std::move(path)), set_example_(std::move(set_example)) {}

void Loader::add_section(const std::string& name, const std::string& example_key) {
  sections_.push_back(name);
  top_keys_.push_back(name);
  section_example_[name] = example_key;
  section_keys_[name];
}

void Loader::declare(const std::string& key, Field field, bool advertised) {
  keys_[key] = {field, advertised};
  const std::string section = section_of(key);
  if (section.empty()) {
    if (advertised) top_keys_.push_back(key);
  } else if (advertised) {
    section_keys_.at(section).push_back(key.substr(section.size() + 1));
  }
}

// The field's value under `name` in `table`.
void Loader::put(toml::table& table, const std::string& name, const Field& field) {
  std::visit(
      [&](auto* value) {
        using T = std::remove_pointer_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::vector<std::string>> || std::is_same_v<T, std::vector<int64_t>> ||
                      std::is_same_v<T, std::vector<double>>) {
          toml::array a;
          for (const auto& x : *value) a.push_back(x);
          table.insert(name, a);
        } else {
          table.insert(name, *value);
        }
      },
      field);
}

toml::table Loader::resolved_table() const {
  toml::table root;
  for (const auto& key : top_keys_) {
    if (const auto it = keys_.find(key); it != keys_.end()) put(root, key, it->second.field);
  }
  for (const auto& section : sections_) {
    toml::table values;
    for (const auto& key : section_keys_.at(section)) put(values, key, keys_.at(section + "." + key).field);
    root.insert(section, values);
  }
  return root;
}

void Loader::add_custom(const std::string& key, CustomReader reader, std::string set_refusal) {
  top_keys_.push_back(key);
  custom_[key] = {std::move(reader), std::move(set_refusal)};
}

void Loader::apply(const toml::table& root, const std::vector<std::string>& sets) {
  // A --set into a table the file wrote as a scalar names the --set (it is the one being applied).
  for (const auto& arg : sets) {
    const auto eq = arg.find('=');
    if (eq == std::string::npos || eq == 0) continue;  // apply_set reports it in its turn
    const std::string section = section_of(arg.substr(0, eq));
    if (section_keys_.count(section) && root.contains(section) && !root.get(section)->is_table()) {
      throw ManifestError(fmt::format("{}: --set '{}': '{}' is not a table in the manifest (write it as [{}])", path_,
                                      arg, section, section));
    }
  }
  for (auto&& [k, v] : root) {
    const std::string key(k.str());
    if (section_keys_.count(key)) {
      const auto* sub = v.as_table();
      if (!sub) fail(path_, key, fmt::format("must be a table ([{}]), got {}", key, toml_type_name(v)));
      for (auto&& [k2, v2] : *sub) apply_key(key + "." + std::string(k2.str()), v2, path_);
    } else if (auto c = custom_.find(key); c != custom_.end()) {
      c->second.first(v, path_);
    } else {
      apply_key(key, v, path_);
    }
  }
  for (const auto& s : sets) apply_set(s);
}

void Loader::apply_set(const std::string& arg) {
  const std::string where = fmt::format("{}: --set '{}'", path_, arg);
  const auto eq = arg.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw ManifestError(fmt::format("{}: expected key=value (e.g. --set {})", where, set_example_));
  }
  const std::string key = arg.substr(0, eq), text = arg.substr(eq + 1);
  for (const auto& [name, c] : custom_) {
    if (key == name || key.rfind(name + ".", 0) == 0) throw ManifestError(fmt::format("{}: {}", where, c.second));
  }
  if (section_keys_.count(key)) {
    throw ManifestError(
        fmt::format("{}: set one key of [{}] at a time (e.g. {}.{}=...)", where, key, key, section_example_.at(key)));
  }
  const toml::table parsed = parse_set_value(text);
  const std::string old = describe_current(key);
  apply_key(key, *parsed.get("v"), where);
  overrides_.push_back(fmt::format("override {} = {} (was {}; from --set)", key, describe_current(key), old));
}

void Loader::apply_key(const std::string& key, const toml::node& n, const std::string& where) {
  auto it = keys_.find(key);
  if (it == keys_.end()) fail_unknown(key, n, where);
  std::visit(
      [&](auto* field) {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, std::vector<std::string>> || std::is_same_v<T, std::vector<int64_t>> ||
                      std::is_same_v<T, std::vector<double>>) {
          *field = get_list<typename T::value_type>(n, key, where);
        } else {
          *field = get<T>(n, key, where);
        }
      },
      it->second.field);
  sources_[key] = where;
  current_[key] = render(n);
}

void Loader::fail_unknown(const std::string& key, const toml::node& n, const std::string& where) const {
  const std::string section = section_of(key), val = render(n);
  if (section_keys_.count(section)) {
    fail(where, key,
         fmt::format("(= {}) is unknown; allowed keys in [{}]: {}", val, section, join(section_keys_.at(section))));
  }
  std::vector<std::string> tables, forms;
  for (const auto& s : sections_) {
    tables.push_back("[" + s + "]");
    forms.push_back(s + ".KEY");
  }
  std::string tables_text = join(tables);
  if (tables.size() > 1) {
    tables_text = join(std::vector<std::string>(tables.begin(), tables.end() - 1)) + " and " + tables.back();
  }
  fail(where, key,
       fmt::format("(= {}) is unknown; allowed top-level keys: {}; {} keys are written {} with --set", val,
                   join(top_keys_), tables_text, join(forms, " / ")));
}

const std::string& Loader::source(const std::string& key) const {
  static const std::string kDefault = "built-in default";
  auto it = sources_.find(key);
  return it == sources_.end() ? kDefault : it->second;
}

std::string Loader::describe_current(const std::string& key) const {
  auto pos = current_.find(key);
  return pos == current_.end() ? std::string("the built-in default") : pos->second;
}

std::string Loader::get_string(const toml::node& n, const std::string& key, const std::string& where) const {
  if (auto v = n.value_exact<std::string>()) return *v;
  fail(where, key, fmt::format("must be a string, got {} {}", toml_type_name(n), render(n)));
}

int64_t Loader::get_int(const toml::node& n, const std::string& key, const std::string& where) const {
  if (auto v = n.value_exact<int64_t>()) return *v;
  fail(where, key, fmt::format("must be an integer, got {} {}", toml_type_name(n), render(n)));
}

double Loader::get_float(const toml::node& n, const std::string& key, const std::string& where) const {
  if (n.is_floating_point() || n.is_integer()) return *n.value<double>();
  fail(where, key, fmt::format("must be a number, got {} {}", toml_type_name(n), render(n)));
}

bool Loader::get_bool(const toml::node& n, const std::string& key, const std::string& where) const {
  if (auto v = n.value_exact<bool>()) return *v;
  fail(where, key, fmt::format("must be true or false, got {} {}", toml_type_name(n), render(n)));
}

void Loader::fail(const std::string& where, const std::string& key, const std::string& what) const {
  throw ManifestError(fmt::format("{}: key '{}' {}", where, key, what));
}

void Loader::check_in(const std::string& key, const std::string& value, const std::vector<std::string>& allowed) const {
  if (std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
    throw ManifestError(
        fmt::format("{}: key '{}' = \"{}\" is not allowed; allowed: {}", source(key), key, value, join(allowed)));
  }
}

void Loader::check(bool ok, const std::string& key, const std::string& value, const std::string& allowed) const {
  if (!ok) {
    throw ManifestError(
        fmt::format("{}: key '{}' = {} is out of range; allowed: {}", source(key), key, value, allowed));
  }
}

void Loader::fail_unique(const std::string& key) const {
  throw ManifestError(
      fmt::format("{}: key '{}' lists a value twice; every axis value must be distinct", source(key), key));
}

}  // namespace collider::harness
