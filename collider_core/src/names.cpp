// The words of the public enums (collider.h: AttentionGrad; select.h: SelectPolicy), what
// manifests, result rows and the Python package spell them. A file of its own, with no other
// dependency, so that a program that only needs the words (the measuring kit's Python module,
// python/src/measure_bindings.cpp) links this object and not the rewrite.
// Tests: tests/test_manifest.cpp (the words a manifest accepts), tests/test_train_step.cpp.
#include <collider/collider.h>
#include <collider/select.h>

#include <stdexcept>
#include <string>

namespace collider {

const char* to_string(AttentionGrad a) { return a == AttentionGrad::kKeptOnly ? "kept_only" : "exact_query"; }

AttentionGrad attention_grad_from_string(const std::string& s) {
  if (s == "kept_only") return AttentionGrad::kKeptOnly;
  if (s == "exact_query") return AttentionGrad::kExactQuery;
  throw std::invalid_argument("unknown attention_grad '" + s + "'; allowed: kept_only, exact_query");
}

const char* to_string(SelectPolicy p) { return p == SelectPolicy::kPerSequence ? "per_sequence" : "batch_topk"; }

SelectPolicy select_policy_from_string(const std::string& s) {
  if (s == "per_sequence") return SelectPolicy::kPerSequence;
  if (s == "batch_topk") return SelectPolicy::kBatchTopK;
  throw std::invalid_argument("unknown selection policy '" + s + "'; allowed: per_sequence, batch_topk");
}

}  // namespace collider
