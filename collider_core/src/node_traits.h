// Internal: what the plan and the rewrite know about each autograd node type (Node::name()), in one
// table beside the row rules (row_rules.h): whether it mixes tokens, its part in an eager attention
// core or around attention sinks, whether it is a fused attention kernel, a reentrant checkpoint, a
// torch.compile graph, a mixture-of-experts route op, a leaf's gradient sink. Every pass reads a
// node type through traits_of(type) instead of comparing type names; the names live in the table
// (node_traits.cpp) and in row_rules.cpp's rule groups. Tests: tests/test_core_plan.cpp (NodeTraits).
#pragma once

#include "row_rules.h"

#include <cstdint>
#include <string_view>

namespace collider::detail {

// Its part in an eager attention core, QK^T -> softmax -> PV (attention_cores.h, token_rows.h).
enum class AttentionRole : uint8_t {
  kNone,
  kMatmul,        // bmm: Q K^T or P V; its operands self, mat2 (the keys: mat2)
  kBiasedMatmul,  // baddbmm: Q K^T with an additive bias (BLOOM's ALiBi); operands batch1, batch2 (edge 0: the bias)
  kSoftmax,       // softmax
  kSafeSoftmax,   // _safe_softmax (the math path of scaled_dot_product_attention under a mask): softmax's
                  // backward and saved fields, but not the node the row attention stand-in replays
};

// Its part around attention sinks (GPT-OSS: scores [.., T] and sinks [.., 1] concatenated, the row
// maximum subtracted, the sinks sliced off after the softmax); the field cut's check_sinks keeps
// such a node only inside an attention core.
enum class SinkRole : uint8_t {
  kNone,
  kCat,       // the sinks appended to the scores
  kMax,       // the row maximum
  kSubtract,  // the row maximum subtracted (its edge 1 may be detached: the detach edit)
  kSlice,     // the sinks sliced off the probabilities: [..., :T]
};

// Its part in a mixture-of-experts layer (routes.h).
enum class RouteRole : uint8_t {
  kNone,
  kScatter,  // index_add: the experts' rows added back into the token rows
  kGather,   // index: the token rows gathered by the route's index
  kRouter,   // top-k, sort: the router's choice of experts
  kExperts,  // grouped_mm: every expert's GEMM on its rows, by offsets
};

// The fused attention kernel a node runs (sdpa.h replaces it whole).
enum class FusedAttention : uint8_t { kNone, kFlashCpu, kFlash, kEfficient, kCudnn };

struct NodeTraits {
  RowRuleEntry row;              // its row rule (row_rules.h)
  bool mixes_tokens = false;     // mixes or indexes positions along a dimension: refused along a token one
  const char* mixing_hint = "";  // what to do when it is refused for that, where a common cause is known
  bool indexes_own_dim = false;  // top-k, sort, gather: a saved index tensor holds positions along its own dim
  bool cat = false;              // torch.cat: cut along the tokens when it concatenates onto empty tensors
  AttentionRole attention = AttentionRole::kNone;
  bool score_op = false;      // a shape or elementwise op that may stand between Q K^T and the softmax
  bool shape_only = false;    // a view or clone: the row attention stand-in passes it unchanged
  bool cast = false;          // a dtype cast (_to_copy)
  bool loss_scaling = false;  // multiplies or casts the loss by a number: loss_root passes over it
  SinkRole sink = SinkRole::kNone;
  FusedAttention fused_attention = FusedAttention::kNone;
  bool reentrant_checkpoint = false;  // torch.utils.checkpoint with use_reentrant=True
  bool compiled_graph = false;        // a torch.compile (AOTAutograd) graph (any type naming CompiledFunction)
  bool copy_slices = false;           // an in-place write into a slice (slices.h)
  bool leaf = false;                  // AccumulateGrad: a leaf tensor's gradient
  RouteRole route = RouteRole::kNone;
  const char* packed_operand = nullptr;  // a GEMM that runs on packed rows: its token operand's saved field
  int8_t packed_edge = -1;               // and that operand's next_edge

  bool softmax() const { return attention == AttentionRole::kSoftmax || attention == AttentionRole::kSafeSoftmax; }
  bool matmul() const { return attention == AttentionRole::kMatmul || attention == AttentionRole::kBiasedMatmul; }
  // A matmul's key operand (its saved field's name) and the edges of its query and key operands.
  const char* key_operand() const { return attention == AttentionRole::kBiasedMatmul ? "batch2" : "mat2"; }
  int query_edge() const { return attention == AttentionRole::kBiasedMatmul ? 1 : 0; }
};

// The traits of a node type; a type the table does not name has none (its row rule: kRefused).
NodeTraits traits_of(std::string_view type);

}  // namespace collider::detail
