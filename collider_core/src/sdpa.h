// Internal: replacing a fused scaled_dot_product_attention backward node (flash, memory-efficient,
// cuDNN, CPU flash) by one that computes the chosen filtered semantics on kept tokens.
#pragma once

#include "token_index.h"

#include "collider/torch_compat.h"

#include <memory>
#include <string>

namespace collider::detail {

// A node computing dQ, dK, dV of kept tokens ([B, H, N, E]) from the gradient of the kept
// output rows, with the fused node's next edges. masked: the same values scattered into
// full-size zero tensors, for full-size gradients (the `masked` method). cross: the keys and
// values are another sequence [B, G, S, E] (a cross-attention onto an encoder's source): the
// kept queries' exact gradient over every key, dK and dV whole (exact_query must be true).
NodePtr make_filtered_attention(const NodePtr& fused, std::shared_ptr<TokenIndex> index, bool exact_query, bool masked,
                                bool cross = false);

}  // namespace collider::detail
