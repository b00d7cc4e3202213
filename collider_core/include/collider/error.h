// collider::Error: the one exception type that leaves Collider's public API (collider.h,
// select.h). Every refusal (a node the rewriter cannot cut, a graph that does not match its
// plan, a bad mask or ratio) is one, with a message that says what to do; the graph it was
// given is unchanged. Python sees it as collider.Error. Two subtypes: UntraceableRoutes marks a
// refusal whose advice depends on the model, GradientMismatch a step the check against
// mask_backward refused (below).
#pragma once

#include <stdexcept>
#include <string>

namespace collider {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// trace_plan's refusal of a mixture-of-experts model when no try on new random tokens gave every
// expert a share of them that its sizes can be read from (none, or exactly a batch's worth): a
// new model's router often sends every token to a few experts. Python: collider.UntraceableRoutes.
class UntraceableRoutes : public Error {
 public:
  using Error::Error;
};

// filter_backward's check of a step against mask_backward (FilterOptions::validate, and the check on
// first use, FilterOptions::check_every) found the filtered gradient different: the message names the
// first node, in backward order, whose incoming gradient differs. The graph is unchanged.
// Python: collider.GradientMismatch.
class GradientMismatch : public Error {
 public:
  using Error::Error;
};

}  // namespace collider
