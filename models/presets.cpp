// The preset table: every architecture's presets (paper size, CPU-scale -mini, unit-test
// -debug), in architecture order. `build/collider models` prints them with parameter counts.
// Tested by tests/test_models.cpp (published parameter counts, analytic == instantiated).
#include "models/common/architecture.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

namespace collider::models {

const std::vector<ModelConfig>& presets() {
  static const std::vector<ModelConfig> all = [] {
    std::vector<ModelConfig> v;
    for (const auto* arch : detail::architectures()) v.insert(v.end(), arch->presets.begin(), arch->presets.end());
    return v;
  }();
  return all;
}

const ModelConfig& preset(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& c : presets()) {
    if (c.name == name) return c;
    names.push_back(c.name);
  }
  throw std::invalid_argument(
      fmt::format("unknown model preset '{}'; known presets: {}", name, fmt::join(names, ", ")));
}

}  // namespace collider::models
