// The method of a training step, in one place: which method (regular, loss_only, collider,
// masked, forward_drop), which attention gradient (collider / masked only), which token selection policy and
// which token scores (DESIGN.md section 2). Manifests parse their words into a MethodSpec once,
// at load; the training step, the FLOP formulas (models/flops.h), the sweep, the training run
// and the benchmarks take it as it is. The attention gradient and the selection policy are the
// public API's enums (collider::AttentionGrad, collider::SelectPolicy), not spelled again here.
// Tests: tests/test_train_step.cpp (names round trip), tests/test_flops.cpp.
#pragma once

#include <collider/collider.h>
#include <collider/select.h>

#include <string>
#include <vector>

namespace collider::models {

enum class Method {
  kRegular,   // no filtering: every token's loss, dense backward
  kLossOnly,  // RHO-1: masked loss, dense backward (what existing systems do)
  kCollider,  // masked loss + collider::filter_backward: backward on kept rows only
  kMasked,    // masked loss + collider::mask_backward: Collider's gradient on zero-masked full tensors
  // Forward token dropping (DeepSpeed's random-LTD): the middle decoder layers see a random subset
  // of kept_count(T, filter_ratio, align) tokens per row (CausalLM::forward(input_ids, middle_BN)),
  // every token's loss counts, plain backward of that smaller graph; no selection, no rewrite.
  kForwardDrop,
};

// Token scores for selection (higher = kept).
enum class Score {
  kSelf,           // "self": the model's own per-token loss
  kRandom,         // "random": seeded uniform scores (timing runs)
  kExcessLoss,     // "excess_loss": current - reference loss (RHO-1); needs the reference losses
  kReferenceLoss,  // "reference_loss": minus the reference loss (lowest reference loss first; does not
                   // depend on the current model, so the same tokens are kept whatever the batch layout)
};

struct MethodSpec {
  Method method = Method::kRegular;
  // Only collider and masked read it (uses_attention_grad); the others' rows say "none".
  collider::AttentionGrad attention_grad = collider::AttentionGrad::kKeptOnly;
  collider::SelectPolicy policy = collider::SelectPolicy::kPerSequence;  // ignored by regular, forward_drop
  Score score = Score::kSelf;                                            // ignored by regular, forward_drop
};

const char* to_string(Method m);
const char* to_string(Score s);
// Throw std::invalid_argument naming the value and listing the allowed names.
Method method_from_string(const std::string& s);
Score score_from_string(const std::string& s);

// The names, in declaration order: what a manifest may write (a schema may allow a subset).
const std::vector<std::string>& method_names();
const std::vector<std::string>& score_names();
const std::vector<std::string>& attention_grad_names();  // collider::to_string(AttentionGrad)
const std::vector<std::string>& policy_names();          // collider::to_string(SelectPolicy)

// True for the methods whose backward depends on attention_grad (collider, masked).
bool uses_attention_grad(Method m);
// True for the methods that select tokens by score (loss_only, collider, masked); regular and
// forward_drop select none (their rows carry score "none" where a row names it).
bool uses_selection(Method m);
// attention_grad's name, or "none" for the methods that do not use it (result rows, point ids).
std::string attention_grad_name(const MethodSpec& spec);

}  // namespace collider::models
