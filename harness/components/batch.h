// One training batch as the step reads it: token ids, their pre-shifted labels and, for RHO-1's
// excess-loss selection, the reference model's per-token losses. Made by the token loader
// (token_data.h) and the synthetic batches of the timing sweeps; read by Trainer::step
// (train_step.h). Legend: B batch, T sequence.
#pragma once

#include <torch/torch.h>

#include <optional>

namespace collider::harness {

struct Batch {
  torch::Tensor input_ids_BT;                // int64 [B, T]
  torch::Tensor labels_BT;                   // int64 [B, T], pre-shifted, -100 = no label
  std::optional<torch::Tensor> ref_loss_BT;  // float [B, T], reference per-token losses (nats)
};

}  // namespace collider::harness
