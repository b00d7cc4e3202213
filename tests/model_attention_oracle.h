// The attention oracle (tests/attention_oracle.h) for our models (models/): installed as the
// model's AttentionHook, it computes every layer's attention core with the reference backward of
// DESIGN.md section 3 on the eager graph. Used by tests/test_models.cpp, test_collider_models.cpp,
// test_collider_ragged.cpp and gpu/test_gpu_collider.cpp (library collider_test_oracle,
// tests/CMakeLists.txt). Legend: B batch, T sequence, H heads, G kv-heads, E head dim.
#pragma once

#include "attention_oracle.h"

#include "models/model.h"

#include <optional>

namespace collider::testing {

// The hook that runs `oracle` (keep_BT must be bool [B, T] of the batch the model is run on).
// It defines an eager backward: a model whose AttentionImpl is kSdpa fails at the forward.
models::AttentionHook attention_oracle_hook(AttentionOracle oracle);
// Installs attention_oracle_hook(*oracle) in `model`, or, with nullopt, clears the hook.
void set_attention_oracle(models::CausalLMImpl& model, std::optional<AttentionOracle> oracle);

}  // namespace collider::testing
