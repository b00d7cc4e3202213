// The node traits table (collider_core/src/node_traits.{h,cpp}): what each pass reads of a node type,
// pinned against the sets and comparisons it replaced, so a change to the table is a visible change
// here: the token-mixing ops and their hint, the attention core's roles, the sinks, the fused kernels,
// the routes, the non-ATen nodes, and the row rule each entry carries.
//   build/tests/test_core_node_traits
#include "../collider_core/src/node_traits.h"

#include <gtest/gtest.h>

#include <string>

using namespace collider::detail;

TEST(NodeTraits, TokenMixingOps) {
  for (const char* t : {"CumsumBackward0",
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
                        "StackBackward0"})
    EXPECT_TRUE(traits_of(t).mixes_tokens) << t;
  for (const char* t : {"AddBackward0", "SoftmaxBackward0", "BmmBackward0", "IndexAddBackward0"})
    EXPECT_FALSE(traits_of(t).mixes_tokens) << t;
  EXPECT_NE(std::string(traits_of("CatBackward0").mixing_hint).find("use_cache=False"), std::string::npos);
  EXPECT_EQ(std::string(traits_of("StackBackward0").mixing_hint), traits_of("CatBackward0").mixing_hint);
  EXPECT_EQ(std::string(traits_of("FlipBackward0").mixing_hint), "");
  for (const char* t : {"TopkBackward0", "SortBackward0", "GatherBackward0"})
    EXPECT_TRUE(traits_of(t).indexes_own_dim) << t;
  EXPECT_FALSE(traits_of("IndexSelectBackward0").indexes_own_dim);
  EXPECT_TRUE(traits_of("CatBackward0").cat);
  EXPECT_FALSE(traits_of("StackBackward0").cat);
}

TEST(NodeTraits, AttentionCoreRoles) {
  EXPECT_EQ(traits_of("BmmBackward0").attention, AttentionRole::kMatmul);
  EXPECT_EQ(traits_of("BaddbmmBackward0").attention, AttentionRole::kBiasedMatmul);
  EXPECT_EQ(std::string(traits_of("BmmBackward0").key_operand()), "mat2");
  EXPECT_EQ(std::string(traits_of("BaddbmmBackward0").key_operand()), "batch2");
  EXPECT_EQ(traits_of("BmmBackward0").query_edge(), 0);
  EXPECT_EQ(traits_of("BaddbmmBackward0").query_edge(), 1);
  EXPECT_TRUE(traits_of("SoftmaxBackward0").softmax());
  EXPECT_TRUE(traits_of("SafeSoftmaxBackward0").softmax());
  EXPECT_EQ(traits_of("SafeSoftmaxBackward0").attention, AttentionRole::kSafeSoftmax);
  EXPECT_FALSE(traits_of("LogSoftmaxBackward0").softmax());
  for (const char* t : {"ToCopyBackward0", "ExpandBackward0", "ViewBackward0", "UnsafeViewBackward0",
                        "ReshapeAliasBackward0", "CloneBackward0", "MaskedFillBackward0", "AddBackward0",
                        "AddBackward1", "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1",
                        "WhereBackward0", "SubBackward0", "SubBackward1", "TanhBackward0", "MaximumBackward0"})
    EXPECT_TRUE(traits_of(t).score_op) << t;
  EXPECT_FALSE(traits_of("ExpBackward0").score_op);
  for (const char* t : {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "CloneBackward0"})
    EXPECT_TRUE(traits_of(t).shape_only) << t;
  EXPECT_FALSE(traits_of("ExpandBackward0").shape_only);
  EXPECT_EQ(traits_of("CatBackward0").sink, SinkRole::kCat);
  EXPECT_EQ(traits_of("MaxBackward0").sink, SinkRole::kMax);
  EXPECT_EQ(traits_of("SubBackward0").sink, SinkRole::kSubtract);
  EXPECT_EQ(traits_of("SliceBackward0").sink, SinkRole::kSlice);
  EXPECT_EQ(traits_of("MaxBackward1").sink, SinkRole::kNone);
}

TEST(NodeTraits, KernelsRoutesAndNodesOutsideATen) {
  EXPECT_EQ(traits_of("ScaledDotProductFlashAttentionForCpuBackward0").fused_attention, FusedAttention::kFlashCpu);
  EXPECT_EQ(traits_of("ScaledDotProductFlashAttentionBackward0").fused_attention, FusedAttention::kFlash);
  EXPECT_EQ(traits_of("ScaledDotProductEfficientAttentionBackward0").fused_attention, FusedAttention::kEfficient);
  EXPECT_EQ(traits_of("ScaledDotProductCudnnAttentionBackward0").fused_attention, FusedAttention::kCudnn);
  EXPECT_EQ(traits_of("BmmBackward0").fused_attention, FusedAttention::kNone);
  EXPECT_TRUE(traits_of("CheckpointFunctionBackward").reentrant_checkpoint);
  EXPECT_TRUE(traits_of("CompiledFunctionBackward").compiled_graph);
  EXPECT_TRUE(traits_of("torch::autograd::CompiledFunctionBackward").compiled_graph);
  EXPECT_FALSE(traits_of("CheckpointFunctionBackward").compiled_graph);
  EXPECT_TRUE(traits_of("torch::autograd::CopySlices").copy_slices);
  EXPECT_TRUE(traits_of("torch::autograd::AccumulateGrad").leaf);
  EXPECT_EQ(traits_of("IndexAddBackward0").route, RouteRole::kScatter);
  EXPECT_EQ(traits_of("IndexBackward0").route, RouteRole::kGather);
  EXPECT_EQ(traits_of("TopkBackward0").route, RouteRole::kRouter);
  EXPECT_EQ(traits_of("SortBackward0").route, RouteRole::kRouter);
  EXPECT_EQ(traits_of("GroupedMmBackward0").route, RouteRole::kExperts);
  EXPECT_EQ(std::string(traits_of("MmBackward0").packed_operand), "self_");
  EXPECT_EQ(traits_of("MmBackward0").packed_edge, 0);
  EXPECT_EQ(std::string(traits_of("AddmmBackward0").packed_operand), "mat1_");
  EXPECT_EQ(traits_of("AddmmBackward0").packed_edge, 1);
  EXPECT_EQ(traits_of("BmmBackward0").packed_operand, nullptr);
  for (const char* t :
       {"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "NegBackward0", "ToCopyBackward0"})
    EXPECT_TRUE(traits_of(t).loss_scaling) << t;
  EXPECT_FALSE(traits_of("SumBackward0").loss_scaling);
  EXPECT_TRUE(traits_of("ToCopyBackward0").cast);
}

// Every entry carries its row rule, and a type no table names has no traits and is refused.
TEST(NodeTraits, RowRuleAndUnknownTypes) {
  for (const char* t : {"AddBackward0", "BmmBackward0", "CumsumBackward0", "torch::autograd::CopySlices"}) {
    EXPECT_EQ(traits_of(t).row.rule, row_rule(t).rule) << t;
    EXPECT_EQ(std::string(traits_of(t).row.reason), row_rule(t).reason) << t;
  }
  const NodeTraits none = traits_of("NoSuchNodeBackward0");
  EXPECT_EQ(none.row.rule, RowRule::kRefused);
  EXPECT_FALSE(none.mixes_tokens || none.leaf || none.copy_slices || none.compiled_graph || none.score_op);
  EXPECT_EQ(none.attention, AttentionRole::kNone);
  EXPECT_EQ(none.route, RouteRole::kNone);
}
