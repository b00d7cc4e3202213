// Token selection: which positions of each sequence keep their loss and activations.
// RHO-1 keeps the tokens with the highest excess loss (model loss - reference loss).
// Legend: B batch, T sequence, N kept tokens per sequence.
#pragma once

#include <collider/error.h>

#include <torch/torch.h>

#include <optional>
#include <string>

namespace collider {

enum class SelectPolicy {
  kPerSequence,  // the same kept count in every row (Collider needs it); drop count rounded up to `align`
  kBatchTopK,    // RHO-1: top (1 - filter_ratio) of the whole batch; ragged rows (a row may keep all or none)
};
const char* to_string(SelectPolicy p);
SelectPolicy select_policy_from_string(const std::string& s);  // "per_sequence" | "batch_topk"

struct SelectOptions {
  SelectPolicy policy = SelectPolicy::kPerSequence;
  int64_t align = 8;  // drop count per row is rounded up to a multiple of this
  // bool [B, T]; false = position has no label: always dropped, not counted toward the ratio.
  std::optional<torch::Tensor> valid_BT;
};

// Failures of the three functions below are collider::Error.
// scores_BT: higher = more worth keeping. filter_ratio in [0, 1): fraction of (valid) positions
// dropped. Returns the keep mask, bool [B, T]. Ties break toward the earlier position.
torch::Tensor select_tokens(const torch::Tensor& scores_BT, double filter_ratio, const SelectOptions& opts = {});

// Kept count per row that kPerSequence gives for a row of T valid positions.
int64_t kept_count(int64_t T, double filter_ratio, int64_t align = 8);

// RHO-1 score: excess loss = model loss - reference loss (both per token, nats).
torch::Tensor excess_loss(const torch::Tensor& model_loss_BT, const torch::Tensor& reference_loss_BT);

}  // namespace collider
