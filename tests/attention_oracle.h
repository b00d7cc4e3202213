// The attention oracle's settings, shared by the tests' two model sets (tests/gpt2_test_model.h and
// tests/model_attention_oracle.h): the reference semantics of DESIGN.md section 3, independent of
// the graph rewriter. kept_only: backward by the section-3 formulas on full-size tensors, dropped
// rows and columns zeroed; exact_query: K and V of dropped tokens detached.
#pragma once

#include <torch/torch.h>

namespace collider::testing {

struct AttentionOracle {
  torch::Tensor keep_BT;  // bool [B, T]
  bool exact_query = false;
};

}  // namespace collider::testing
