// Internal: which autograd nodes collider may cut along a token dimension, and why. Cutting a
// node's fields to the kept rows is exact only where the node acts row by row along that
// dimension: every output row made from the same row of its inputs, every input row's gradient
// from the same row of the output's gradient and of the saved tensors. So a node type is cut only
// under a rule that says so; every other type, and every type the rules do not name, runs whole
// when one of its fields has a token dimension ("not known to act row by row"; NodeSpec::run_whole,
// edits/run_whole.cpp), never guessed. A fused attention kernel with no replacement is refused.
// The rules of all node types of the generated handlers (node_fields.h) are listed in
// docs/ROW_RULES.md (`build/collider row-rules` writes it); the property test
// python/tests/test_row_rules.py runs PyTorch's own sample inputs (OpInfo) through the ops the
// rules cut and checks the rows do not move each other. check_row_rules is the last of the plan's
// passes (passes/table.cpp).
#pragma once

#include "graph.h"
#include "observe.h"
#include "plan_impl.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace collider::detail {

enum class RowRule : uint8_t {
  kPointwise,  // element by element, with broadcasting: any dimension may be a token dimension
  kLayout,     // moves elements without combining them (views, transposes, copies, casts, expand):
               // the token dimensions are followed through the sizes (classify.h)
  kAlongDim,   // acts along its `dim` / `dims` (softmax, cat, split, select, flip, FFTs, ...): cut
               // only when none of them is a token dimension
  kReduction,  // reduces over some dimensions: cut when every token dimension survives in its output,
               // or as the loss's own reduction (nothing token-shaped between it and the loss)
  kNorm,       // normalises over its trailing `normalized_shape`: cut when that holds no token dimension
  kMatmul,     // contracts its operands' inner dimension: cut when that is not a token dimension, or
               // inside a recognised attention core (P V over the key columns)
  kRepeat,     // tiles its input: cut when no token dimension is repeated
  kLookup,     // reads rows by the token ids or indices it saved (an embedding, a gather, a scatter):
               // cut as trace_plan's route and index checks allow (routes.h, classify.h)
  kAttention,  // fused attention: replaced whole where its query and key positions are the tokens and
               // sdpa.h has a replacement for the kernel; refused otherwise
  kRefused,    // mixes, scans, shifts, sorts, convolves or pools along its dimensions, addresses
               // storage, or is not known to act row by row
};

struct RowRuleEntry {
  RowRule rule = RowRule::kRefused;
  const char* reason = "";
};

// The rule of a node type (Node::name()); a type no rule names is kRefused.
RowRuleEntry row_rule(std::string_view type);
const char* rule_name(RowRule rule);
// Every generated node type with its rule, in Functions.h order (docs/ROW_RULES.md).
std::vector<std::pair<std::string, RowRuleEntry>> row_rule_table();

// Marks run whole every node with a token-dimension field that its rule does not let collider cut;
// throws collider::Error for a fused attention kernel with no replacement. Runs after every field is
// classified and the attention cores are found.
void check_row_rules(const Graph& g, PlanData& plan, const std::vector<ObservedNode>& observed);

}  // namespace collider::detail
