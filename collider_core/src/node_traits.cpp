// The node traits table (see node_traits.h): every node type name a pass needs to know, grouped by
// what it tells, each group with why. A type may be in several groups; traits_of merges them and adds
// the type's row rule (row_rules.cpp). Tests: tests/test_core_plan.cpp (NodeTraits).
#include "node_traits.h"

#include <initializer_list>
#include <string>
#include <unordered_map>

namespace collider::detail {

namespace {

using Types = std::initializer_list<const char*>;

std::unordered_map<std::string_view, NodeTraits> make_traits() {
  std::unordered_map<std::string_view, NodeTraits> t;
  auto each = [&](Types types, auto set) {
    for (const char* type : types) set(t[type]);
  };

  // Ops that mix tokens along a dimension; cutting rows would change their meaning (classify.h:
  // along_token_dim says when the dimension they act along is a token one).
  each({"CumsumBackward0",
        "CumprodBackward0",
        "LogcumsumexpBackward0",
        "FlipBackward0",
        "RollBackward0",
        "SortBackward0",
        "TopkBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "NarrowBackward0",
        "IndexSelectBackward0",
        "GatherBackward0",
        "UnfoldBackward0",
        "ConstantPadNdBackward0",
        "ConvolutionBackward0",
        "CumulativeTrapezoidBackward0",
        "DiffBackward0",
        "MaxBackward0",
        "MinBackward0",
        "MaxBackward1",
        "MinBackward1",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "UnsafeSplitBackward0",
        "UnsafeSplitWithSizesBackward0",
        "CatBackward0",
        "StackBackward0"},
       [](NodeTraits& n) { n.mixes_tokens = true; });
  // A KV cache concatenates along the sequence.
  each({"CatBackward0", "StackBackward0"}, [](NodeTraits& n) {
    n.mixing_hint =
        " (a KV cache concatenates along the sequence: with Hugging Face transformers pass use_cache=False "
        "to the training forward)";
  });
  // Their saved indices are positions along their own `dim` (a router's top-k over experts), not
  // token positions.
  each({"TopkBackward0", "SortBackward0", "GatherBackward0"}, [](NodeTraits& n) { n.indexes_own_dim = true; });
  // A concatenation onto empty tensors (a KV cache at its first step) keeps every position.
  each({"CatBackward0"}, [](NodeTraits& n) { n.cat = true; });

  // Eager attention cores (attention_cores.h): Q K^T and P V batched matmuls around a softmax.
  each({"BmmBackward0"}, [](NodeTraits& n) { n.attention = AttentionRole::kMatmul; });
  // Q K^T may carry an additive bias: BLOOM's ALiBi, bias.baddbmm(Q, K^T).
  each({"BaddbmmBackward0"}, [](NodeTraits& n) { n.attention = AttentionRole::kBiasedMatmul; });
  each({"SoftmaxBackward0"}, [](NodeTraits& n) { n.attention = AttentionRole::kSoftmax; });
  each({"SafeSoftmaxBackward0"}, [](NodeTraits& n) { n.attention = AttentionRole::kSafeSoftmax; });
  // Between Q K^T and the softmax: shape and scale ops, masks and biases, all row-local.
  each({"ToCopyBackward0", "ExpandBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
        "CloneBackward0", "MaskedFillBackward0", "AddBackward0", "AddBackward1", "MulBackward0", "MulBackward1",
        "DivBackward0", "DivBackward1", "WhereBackward0", "SubBackward0", "SubBackward1",
        "TanhBackward0",      // Gemma2's logit soft-capping, cap * tanh(s / cap): elementwise, so row-local
        "MaximumBackward0"},  // XGLM's floor on the masked scores, max(s, finfo.min): elementwise too
       [](NodeTraits& n) { n.score_op = true; });
  // Views and clones: the row attention stand-in (row_attention.h) passes them unchanged.
  each({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "CloneBackward0"},
       [](NodeTraits& n) { n.shape_only = true; });
  each({"ToCopyBackward0"}, [](NodeTraits& n) { n.cast = true; });
  // What a loss is multiplied, divided, negated or cast by before backward (graph.h: loss_root).
  each({"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "NegBackward0", "ToCopyBackward0"},
       [](NodeTraits& n) { n.loss_scaling = true; });

  // Attention sinks (GPT-OSS).
  each({"CatBackward0"}, [](NodeTraits& n) { n.sink = SinkRole::kCat; });
  each({"MaxBackward0"}, [](NodeTraits& n) { n.sink = SinkRole::kMax; });
  each({"SubBackward0"}, [](NodeTraits& n) { n.sink = SinkRole::kSubtract; });
  each({"SliceBackward0"}, [](NodeTraits& n) { n.sink = SinkRole::kSlice; });

  // Fused attention kernels that sdpa.h replaces whole.
  each({"ScaledDotProductFlashAttentionForCpuBackward0"},
       [](NodeTraits& n) { n.fused_attention = FusedAttention::kFlashCpu; });
  each({"ScaledDotProductFlashAttentionBackward0"}, [](NodeTraits& n) { n.fused_attention = FusedAttention::kFlash; });
  each({"ScaledDotProductEfficientAttentionBackward0"},
       [](NodeTraits& n) { n.fused_attention = FusedAttention::kEfficient; });
  each({"ScaledDotProductCudnnAttentionBackward0"}, [](NodeTraits& n) { n.fused_attention = FusedAttention::kCudnn; });

  // Nodes that are not ATen ops.
  each({"CheckpointFunctionBackward"}, [](NodeTraits& n) { n.reentrant_checkpoint = true; });
  each({"torch::autograd::CopySlices"}, [](NodeTraits& n) { n.copy_slices = true; });
  each({"torch::autograd::AccumulateGrad"}, [](NodeTraits& n) { n.leaf = true; });

  // Mixture-of-experts layers (routes.h).
  each({"IndexAddBackward0"}, [](NodeTraits& n) { n.route = RouteRole::kScatter; });
  each({"IndexBackward0"}, [](NodeTraits& n) { n.route = RouteRole::kGather; });
  each({"TopkBackward0", "SortBackward0"}, [](NodeTraits& n) { n.route = RouteRole::kRouter; });
  each({"GroupedMmBackward0"}, [](NodeTraits& n) { n.route = RouteRole::kExperts; });

  // GEMMs whose backward may run on packed rows (edits/packed_rows.cpp): mm(x, W), addmm(b, x, W).
  each({"MmBackward0"}, [](NodeTraits& n) {
    n.packed_operand = "self_";
    n.packed_edge = 0;
  });
  each({"AddmmBackward0"}, [](NodeTraits& n) {
    n.packed_operand = "mat1_";
    n.packed_edge = 1;
  });
  return t;
}

}  // namespace

NodeTraits traits_of(std::string_view type) {
  static const std::unordered_map<std::string_view, NodeTraits> table = make_traits();
  auto it = table.find(type);
  NodeTraits out = it == table.end() ? NodeTraits{} : it->second;
  out.row = row_rule(type);
  // torch.compile names its nodes CompiledFunctionBackward, CompiledFunction... (by version): a pattern.
  out.compiled_graph = type.find("CompiledFunction") != std::string_view::npos;
  return out;
}

}  // namespace collider::detail
