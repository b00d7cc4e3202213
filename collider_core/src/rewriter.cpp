// Placeholder: the graph rewriter lands in the next commits.
#include <collider/collider.h>
#include "node_fields.h"
namespace collider {
struct Plan::Impl {};
Plan::Plan() : impl_(std::make_unique<Impl>()) {}
Plan::~Plan() = default;
Plan::Plan(const Plan& o) : impl_(std::make_unique<Impl>(*o.impl_)) {}
Plan& Plan::operator=(const Plan& o) { impl_ = std::make_unique<Impl>(*o.impl_); return *this; }
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(Plan&&) noexcept = default;
std::string Plan::to_string() const { throw Error("not implemented"); }
Plan Plan::from_string(const std::string&) { throw Error("not implemented"); }
int64_t Plan::num_nodes() const { return 0; }
int64_t Plan::num_token_nodes() const { return 0; }
std::string Plan::summary() const { return ""; }
const char* to_string(AttentionGrad a) { return a == AttentionGrad::kKeptOnly ? "kept_only" : "exact_query"; }
AttentionGrad attention_grad_from_string(const std::string& s) {
  if (s == "kept_only") return AttentionGrad::kKeptOnly;
  if (s == "exact_query") return AttentionGrad::kExactQuery;
  throw std::invalid_argument("unknown attention_grad '" + s + "'; allowed: kept_only, exact_query");
}
Plan trace_plan(const LossOnBatchFn&, const TraceOptions&) { throw Error("trace_plan: not implemented yet"); }
FilterStats filter_backward(const torch::Tensor&, const torch::Tensor&, const Plan&, const FilterOptions&) { throw Error("filter_backward: not implemented yet"); }
FilterStats mask_backward(const torch::Tensor&, const torch::Tensor&, const Plan&, const FilterOptions&) { throw Error("mask_backward: not implemented yet"); }
void register_passthrough_node(const std::string&) {}
}
