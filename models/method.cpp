// The names of a MethodSpec's parts and their parsing (method.h).
#include "models/method.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

namespace collider::models {
namespace {

template <class E>
E from_name(const std::string& s, const std::vector<std::string>& names, const char* what) {
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == s) return static_cast<E>(i);
  }
  throw std::invalid_argument(fmt::format("unknown {} '{}'; allowed: {}", what, s, fmt::join(names, ", ")));
}

}  // namespace

const std::vector<std::string>& method_names() {
  static const std::vector<std::string> names = {"regular", "loss_only", "collider", "masked", "forward_drop"};
  return names;
}

const std::vector<std::string>& score_names() {
  static const std::vector<std::string> names = {"self", "random", "excess_loss", "reference_loss"};
  return names;
}

const std::vector<std::string>& attention_grad_names() {
  static const std::vector<std::string> names = {collider::to_string(collider::AttentionGrad::kKeptOnly),
                                                 collider::to_string(collider::AttentionGrad::kExactQuery)};
  return names;
}

const std::vector<std::string>& policy_names() {
  static const std::vector<std::string> names = {collider::to_string(collider::SelectPolicy::kPerSequence),
                                                 collider::to_string(collider::SelectPolicy::kBatchTopK)};
  return names;
}

const char* to_string(Method m) { return method_names().at(static_cast<size_t>(m)).c_str(); }
const char* to_string(Score s) { return score_names().at(static_cast<size_t>(s)).c_str(); }

Method method_from_string(const std::string& s) { return from_name<Method>(s, method_names(), "method"); }
Score score_from_string(const std::string& s) { return from_name<Score>(s, score_names(), "score"); }

bool uses_attention_grad(Method m) { return m == Method::kCollider || m == Method::kMasked; }

bool uses_selection(Method m) { return m != Method::kRegular && m != Method::kForwardDrop; }

std::string attention_grad_name(const MethodSpec& spec) {
  return uses_attention_grad(spec.method) ? collider::to_string(spec.attention_grad) : "none";
}

}  // namespace collider::models
