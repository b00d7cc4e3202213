// The row rules of autograd node types and the check trace_plan runs with them (see row_rules.h).
#include "row_rules.h"

#include "classify.h"
#include "node_traits.h"
#include "node_fields.h"

#include <collider/collider.h>

#include <fmt/format.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <unordered_map>

namespace collider::detail {

namespace {

// One rule, the reason a reader of docs/ROW_RULES.md sees, and the node types it covers.
struct RuleGroup {
  RowRule rule;
  const char* reason;
  std::vector<const char*> types;
};

const std::vector<RuleGroup>& rule_groups() {
  static const std::vector<RuleGroup> k = {
      {RowRule::kPointwise,
       "element by element (broadcasting repeats a row, never mixes two)",
       {"AbsBackward0",
        "AcosBackward0",
        "AddBackward0",
        "AddBackward1",
        "AddcdivBackward0",
        "AddcmulBackward0",
        "AddrBackward0",
        "AngleBackward0",
        "AcoshBackward0",
        "AcoshBackward1",
        "AsinhBackward0",
        "AsinhBackward1",
        "AtanhBackward0",
        "AtanhBackward1",
        "AsinBackward0",
        "AtanBackward0",
        "Atan2Backward0",
        "CeilBackward0",
        "ClampBackward0",
        "ClampBackward1",
        "ClampMinBackward0",
        "ClampMinBackward1",
        "ClampMaxBackward0",
        "ClampMaxBackward1",
        "ComplexBackward0",
        "PolarBackward0",
        "ConjBackward0",
        "NegViewBackward0",
        "ConjPhysicalBackward0",
        "ConjPhysicalBackward1",
        "CopysignBackward0",
        "CopysignBackward1",
        "CosBackward0",
        "CoshBackward0",
        "Deg2RadBackward0",
        "DivBackward0",
        "DivBackward1",
        "DivBackward2",
        "DivBackward3",
        "FusedDropoutBackward0",
        "NativeDropoutBackward0",
        "EqBackward0",
        "EqBackward1",
        "ErfBackward0",
        "ErfcBackward0",
        "SpecialErfcxBackward0",
        "ErfinvBackward0",
        "ExpBackward0",
        "Exp2Backward0",
        "Expm1Backward0",
        "FillBackward0",
        "FillBackward1",
        "FillBackward2",
        "FillBackward3",
        "FloorBackward0",
        "FmodBackward0",
        "FmodBackward1",
        "FracBackward0",
        "GeBackward0",
        "GeBackward1",
        "GtBackward0",
        "GtBackward1",
        "HardsigmoidBackward0",
        "HardswishBackward0",
        "HypotBackward0",
        "I0Backward0",
        "SpecialI0EBackward0",
        "SpecialI1Backward0",
        "SpecialI1EBackward0",
        "LdexpBackward0",
        "LeBackward0",
        "LeBackward1",
        "LerpBackward0",
        "LerpBackward1",
        "LgammaBackward0",
        "DigammaBackward0",
        "PolygammaBackward0",
        "PolygammaBackward1",
        "LogBackward0",
        "Log10Backward0",
        "Log1PBackward0",
        "Log2Backward0",
        "LogaddexpBackward0",
        "Logaddexp2Backward0",
        "XlogyBackward0",
        "XlogyBackward1",
        "XlogyBackward2",
        "SpecialXlog1PyBackward0",
        "SpecialXlog1PyBackward1",
        "SpecialXlog1PyBackward2",
        "LtBackward0",
        "LtBackward1",
        "MaskedFillBackward0",
        "MaskedFillBackward1",
        "MaximumBackward0",
        "FmaxBackward0",
        "MinimumBackward0",
        "FminBackward0",
        "MulBackward0",
        "MulBackward1",
        "NanToNumBackward0",
        "NeBackward0",
        "NeBackward1",
        "NegBackward0",
        "NextafterBackward0",
        "PowBackward0",
        "PowBackward1",
        "PowBackward2",
        "Rad2DegBackward0",
        "ReciprocalBackward0",
        "RemainderBackward0",
        "RemainderBackward1",
        "RoundBackward0",
        "RoundBackward1",
        "RsqrtBackward0",
        "SigmoidBackward0",
        "LogitBackward0",
        "SignBackward0",
        "SgnBackward0",
        "SinBackward0",
        "SincBackward0",
        "SinhBackward0",
        "SqrtBackward0",
        "SubBackward0",
        "SubBackward1",
        "RsubBackward0",
        "RsubBackward1",
        "TanBackward0",
        "TanhBackward0",
        "TruncBackward0",
        "WhereBackward0",
        "ZeroBackward0",
        "ReluBackward0",
        "SiluBackward0",
        "MishBackward0",
        "EluBackward0",
        "EluBackward1",
        "CeluBackward0",
        "CeluBackward1",
        "GeluBackward0",
        "HardshrinkBackward0",
        "HardtanhBackward0",
        "LeakyReluBackward0",
        "LeakyReluBackward1",
        "LogSigmoidBackward0",
        "SoftplusBackward0",
        "SoftshrinkBackward0",
        "ThresholdBackward0",
        "ThresholdBackward1",
        "SpecialEntrBackward0",
        "SpecialNdtriBackward0",
        "SpecialLogNdtrBackward0"}},
      {RowRule::kLayout,
       "moves elements without combining them; the token dimensions are followed through its sizes",
       {"AliasBackward0",        "CloneBackward0",         "LazyCloneBackward0",    "ToCopyBackward0",
        "ExpandBackward0",       "PermuteBackward0",       "ReshapeAliasBackward0", "SqueezeBackward0",
        "SqueezeBackward1",      "SqueezeBackward2",       "SqueezeBackward3",      "SqueezeBackward4",
        "SqueezeBackward5",      "TBackward0",             "TBackward1",            "TransposeBackward0",
        "TransposeBackward1",    "UnsafeViewBackward0",    "LiftBackward0",         "LiftFreshBackward0",
        "UnsqueezeBackward0",    "UnsqueezeBackward1",     "ViewBackward0",         "ViewAsRealBackward0",
        "ViewAsComplexBackward0", "ReshapeCopyBackward0",  "AliasBackward0_copy",   "ExpandBackward0_copy",
        "PermuteBackward0_copy", "ReshapeAliasBackward0_copy", "SqueezeBackward0_copy", "SqueezeBackward1_copy",
        "SqueezeBackward2_copy", "TBackward0_copy",        "TransposeBackward0_copy", "UnsqueezeBackward0_copy",
        "ViewBackward0_copy",    "ViewAsRealBackward0_copy", "ViewAsComplexBackward0_copy", "ConjBackward0_copy",
        "NegViewBackward0_copy", "LiftFreshBackward0_copy"}},
      {RowRule::kAlongDim,
       "acts along its dim (or dims): cut when none of them is a token dimension",
       {"SoftmaxBackward0",
        "SafeSoftmaxBackward0",
        "LogSoftmaxBackward0",
        "GluBackward0",
        "CatBackward0",
        "StackBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "UnsafeSplitBackward0",
        "UnsafeSplitWithSizesBackward0",
        "ChunkBackward0",
        "UnbindBackward0",
        "UnbindBackward0_copy",
        "SplitBackward0_copy",
        "SplitWithSizesBackward0_copy",
        "SelectBackward0",
        "SelectBackward0_copy",
        "SliceBackward0",
        "SliceBackward0_copy",
        "NarrowBackward0",
        "IndexSelectBackward0",
        "GatherBackward0",
        "CumsumBackward0",
        "CumprodBackward0",
        "LogcumsumexpBackward0",
        "CummaxBackward0",
        "CumminBackward0",
        "SortBackward0",
        "SortBackward1",
        "TopkBackward0",
        "KthvalueBackward0",
        "ModeBackward0",
        "MedianBackward1",
        "NanmedianBackward1",
        "MaxBackward0",
        "MinBackward0",
        "FlipBackward0",
        "RollBackward0",
        "UnfoldBackward0",
        "DiffBackward0",
        "FftR2CBackward0",
        "FftC2RBackward0",
        "FftC2CBackward0"}},
      {RowRule::kReduction,
       "reduces over some dimensions: cut when its output keeps every token dimension, or as the "
       "loss's own reduction",
       {"SumBackward0",
        "SumBackward1",
        "NansumBackward0",
        "MeanBackward0",
        "MeanBackward1",
        "AmaxBackward0",
        "AminBackward0",
        "MaxBackward1",
        "MinBackward1",
        "MedianBackward0",
        "NanmedianBackward0",
        "ProdBackward0",
        "ProdBackward1",
        "StdBackward0",
        "StdMeanBackward0",
        "VarBackward0",
        "VarMeanBackward0",
        "NormBackward0",
        "NormBackward1",
        "NormBackward2",
        "NormBackward3",
        "LinalgVectorNormBackward0",
        "LogsumexpBackward0",
        "NllLossBackward0",
        "BinaryCrossEntropyBackward0",
        "MseLossBackward0",
        "SmoothL1LossBackward0",
        "HuberLossBackward0",
        "SoftMarginLossBackward0",
        "BinaryCrossEntropyWithLogitsBackward0"}},
      {RowRule::kNorm,
       "normalises over its trailing normalized_shape: cut when that holds no token dimension",
       {"NativeLayerNormBackward0", "FusedRmsNormBackward0"}},
      {RowRule::kMatmul,
       "contracts its operands' inner dimension: cut when that is not a token dimension, or inside a "
       "recognised attention core",
       {"MmBackward0", "BmmBackward0", "AddmmBackward0", "BaddbmmBackward0", "MatmulBackward0", "LinearBackward0",
        "MvBackward0", "AddmvBackward0", "DotBackward0", "VdotBackward0", "GroupedMmBackward0"}},
      {RowRule::kRepeat, "tiles its input: cut when no token dimension is repeated", {"RepeatBackward0"}},
      {RowRule::kLookup,
       "reads or writes rows by the indices it saved: cut as trace_plan's route and index checks allow",
       {"EmbeddingBackward0", "IndexBackward0", "UnsafeIndexBackward0", "IndexAddBackward0", "IndexPutBackward0",
        "UnsafeIndexPutBackward0", "IndexPutImplBackward0", "ScatterBackward0", "ScatterBackward1",
        "ScatterAddBackward0", "ScatterReduceBackward0", "IndexCopyBackward0", "IndexFillBackward0",
        "IndexFillBackward1"}},
      {RowRule::kAttention,
       "fused attention: replaced whole where its query and key positions are the tokens and collider has a "
       "replacement for the kernel (scaled_dot_product_attention's CPU flash, flash, memory-efficient and cuDNN "
       "backwards)",
       {"ScaledDotProductEfficientAttentionBackward0", "ScaledDotProductFlashAttentionBackward0",
        "ScaledDotProductFlashAttentionForCpuBackward0", "FlashAttentionBackward0", "EfficientAttentionBackward0",
        "CudnnAttentionBackward0", "ScaledDotProductCudnnAttentionBackward0",
        "ScaledDotProductFusedAttentionOverrideableBackward0"}},
      {RowRule::kRefused,
       "mixes positions (pooling, a convolution, a normalisation over the batch or over every dimension "
       "but one, masked selection, positional masking) or addresses storage directly",
       {"TrilBackward0",
        "TriuBackward0",
        "AsStridedBackward0",
        "AsStridedBackward1",
        "AsStridedBackward0_copy",
        "AsStridedScatterBackward0",
        "DiagonalBackward0",
        "DiagonalBackward0_copy",
        "DiagEmbedBackward0",
        "MaskedSelectBackward0",
        "MaskedScatterBackward0",
        "TakeBackward0",
        "PutBackward0",
        "ConstantPadNdBackward0",
        "ConvolutionBackward0",
        "ConvolutionBackward1",
        "ConvTbcBackward0",
        "NativeBatchNormBackward0",
        "NativeBatchNormLegitBackward0",
        "NativeBatchNormLegitNoTrainingBackward0",
        "NativeBatchNormLegitBackward1",
        "BatchNormWithUpdateBackward0",
        "BatchNormNoUpdateBackward0",
        "NativeGroupNormBackward0",
        "SliceScatterBackward0",
        "SelectScatterBackward0",
        "DiagonalScatterBackward0",
        "CumulativeTrapezoidBackward0",
        "TraceBackward0",
        "AddbmmBackward0",
        "CdistBackward0",
        "PdistBackward0",
        "EuclideanDistBackward0",
        "DistBackward0",
        "RenormBackward0"}},
  };
  return k;
}

const std::unordered_map<std::string_view, RowRuleEntry>& rule_index() {
  static const std::unordered_map<std::string_view, RowRuleEntry> k = [] {
    std::unordered_map<std::string_view, RowRuleEntry> m;
    for (const auto& g : rule_groups())
      for (const char* t : g.types) m.emplace(t, RowRuleEntry{g.rule, g.reason});
    return m;
  }();
  return k;
}

constexpr const char* kUnknownReason = "not known to act row by row along a token dimension";

bool has_token_field(const NodeSpec& ns) {
  for (const auto& f : ns.fields)
    if (f.shape.has_token()) return true;
  return false;
}

bool is_token_dim(const ShapeSpec& s, int64_t d) {
  for (const auto& ds : s.dims)
    if (ds.dim == d && ds.kind != DimKind::kBatch) return true;
  return false;
}

int64_t count_token_dims(const ShapeSpec& s) {
  int64_t n = 0;
  for (const auto& ds : s.dims) n += ds.kind != DimKind::kBatch ? 1 : 0;
  return n;
}

bool has_field(const NodeSpec& ns, const char* name) {
  for (const auto& f : ns.fields)
    if (f.name == name) return true;
  return false;
}

const Observed* observed_field(const ObservedNode& o, const char* name) {
  for (const auto& f : o.fields)
    if (f.name == name) return &f;
  return nullptr;
}

// The field a `dim` of the node counts in: its input (self), else its output.
const FieldSpec* reference_field(const NodeSpec& ns) {
  for (const char* name : {"self_sym_sizes", "self_", "self", "input_", "result_", "result"})
    for (const auto& f : ns.fields)
      if (f.name == name && f.kind != FieldKind::kInputMeta) return &f;
  return ns.find(FieldKind::kInputMeta, 0);
}

// The nodes with nothing token-shaped between them and the loss: where a reduction over the tokens
// is the loss's own (a masked loss's sum or mean, a cross-entropy's reduction).
std::vector<bool> below_token_free_path(const Graph& g, const PlanData& plan) {
  const size_t n = plan.nodes.size();
  std::vector<int> pending(n, 0);
  for (size_t i = 0; i < n; ++i) pending[i] = static_cast<int>(g.parents[i].size());
  std::vector<bool> free(n, true);
  std::vector<int> queue;
  for (size_t i = 0; i < n; ++i)
    if (pending[i] == 0) queue.push_back(static_cast<int>(i));
  while (!queue.empty()) {
    const int i = queue.back();
    queue.pop_back();
    const bool pass = free[i] && !has_token_field(plan.nodes[i]);
    for (const auto& e : g.nodes[i]->next_edges()) {
      if (!e.function) continue;
      const int c = g.index.at(e.function.get());
      if (!pass) free[c] = false;
      if (--pending[c] == 0) queue.push_back(c);
    }
  }
  return free;
}

}  // namespace

RowRuleEntry row_rule(std::string_view type) {
  auto it = rule_index().find(type);
  return it == rule_index().end() ? RowRuleEntry{RowRule::kRefused, kUnknownReason} : it->second;
}

const char* rule_name(RowRule rule) {
  switch (rule) {
    case RowRule::kPointwise: return "pointwise";
    case RowRule::kLayout: return "layout";
    case RowRule::kAlongDim: return "along dim";
    case RowRule::kReduction: return "reduction";
    case RowRule::kNorm: return "norm";
    case RowRule::kMatmul: return "matmul";
    case RowRule::kRepeat: return "repeat";
    case RowRule::kLookup: return "lookup";
    case RowRule::kAttention: return "attention";
    case RowRule::kRefused: return "refused";
  }
  return "refused";
}

std::vector<std::pair<std::string, RowRuleEntry>> row_rule_table() {
  std::vector<std::pair<std::string, RowRuleEntry>> out;
  for (const char* t : generated_node_types()) out.emplace_back(t, row_rule(t));
  return out;
}

void check_row_rules(const Graph& g, PlanData& plan, const std::vector<ObservedNode>& observed) {
  const std::vector<bool> loss_side = below_token_free_path(g, plan);
  for (size_t i = 0; i < plan.nodes.size(); ++i) {
    const NodeSpec& ns = plan.nodes[i];
    if (!find_node_fields(*g.nodes[i]) || ns.fused_attention || ns.run_whole || !has_token_field(ns)) continue;
    const RowRuleEntry entry = row_rule(ns.type);
    auto refuse = [&](const std::string& why) {
      throw Error(fmt::format("collider cannot rewrite node {} (#{}): {}; cutting its token rows would change its "
                              "result. Write the model without it, or train it without token filtering",
                              ns.type, i, why));
    };
    // What does not act row by row along its token dimensions runs whole (NodeSpec::run_whole).
    bool whole = false;
    auto run_whole = [&](const std::string&) { whole = true; };
    switch (entry.rule) {
      case RowRule::kPointwise:
      case RowRule::kLayout:
      case RowRule::kLookup: break;
      case RowRule::kAttention:  // (the ones replaced whole are passed over above)
        refuse("a fused attention kernel over the tokens that collider has no replacement for (sdpa.h); use "
               "attn_implementation=\"eager\" or \"sdpa\"");
        break;
      case RowRule::kRefused: run_whole(entry.reason); break;
      case RowRule::kAlongDim: {
        // An attention core's softmax runs over the key columns, which the core's rewrite cuts as its
        // semantics say; the token-mixing ops were checked where their fields were classified
        // (passes/token_mixing.cpp: concatenations onto an empty cache, attention sinks); an unbind along a token
        // dimension would give as many nodes as tokens, which trace_plan refuses already.
        if (ns.attention_core || traits_of(ns.type).mixes_tokens || ns.type.rfind("UnbindBackward0", 0) == 0) break;
        const FieldSpec* ref = reference_field(ns);
        const Observed* dims = observed_field(observed[i], "dim");
        if (!dims) dims = observed_field(observed[i], "dims");
        std::vector<int64_t> along;
        if (observed[i].dim) along.push_back(*observed[i].dim);
        if (dims && !dims->scalar) along.insert(along.end(), dims->values.begin(), dims->values.end());
        if (!ref || along.empty()) {
          run_whole("it acts along a dimension collider cannot see");
          break;
        }
        for (int64_t d : along) {
          const int64_t a = d < 0 ? d + ref->shape.rank : d;
          if (is_token_dim(ref->shape, a)) run_whole(fmt::format("it acts along dimension {}, a token dimension", d));
        }
        break;
      }
      case RowRule::kReduction: {
        const FieldSpec* out = ns.find(FieldKind::kInputMeta, 0);
        const int64_t kept = out ? count_token_dims(out->shape) : 0;
        int64_t most = 0;
        for (const auto& f : ns.fields)
          if (f.kind != FieldKind::kInputMeta) most = std::max(most, count_token_dims(f.shape));
        if (kept < most && !loss_side[i])
          run_whole("it reduces over a token dimension, and its result flows back into token-shaped tensors");
        break;
      }
      case RowRule::kNorm:
        if (has_field(ns, "normalized_shape")) run_whole("it normalises over a token dimension");
        break;
      case RowRule::kMatmul: {
        if (ns.attention_core) break;
        // The inner dimension: the last of the first operand (and of a linear's weight), the one
        // before the last of the second (the only one of a vector).
        auto starts = [](const std::string& name, std::initializer_list<const char*> prefixes) {
          for (const char* p : prefixes)
            if (name.rfind(p, 0) == 0) return true;
          return false;
        };
        for (const auto& f : ns.fields) {
          if (f.kind == FieldKind::kInputMeta) continue;
          const bool first = starts(f.name, {"self", "mat1", "batch1", "input", "mat_", "weight"});
          const bool second = starts(f.name, {"mat2", "batch2", "other", "vec", "tensor"});
          if (!first && !second) continue;  // offsets, strides
          const int32_t r = f.shape.rank;
          const int64_t inner = first || r < 2 ? r - 1 : r - 2;
          if (is_token_dim(f.shape, inner))
            run_whole("it sums products over a token dimension outside an attention core collider recognises");
        }
        break;
      }
      case RowRule::kRepeat: {
        const Observed* repeats = observed_field(observed[i], "repeats");
        const FieldSpec* self = ns.find(FieldKind::kSizes, 0, "self_sym_sizes");
        // Refused, not run whole: the copies' rows are in an order the cut of its neighbours would misread.
        if (!repeats) refuse("it repeats its input along dimensions collider cannot see");
        if (!self) break;  // the input has no token dimension: its copies are new rows of their own
        // Tiling a token or batch dimension k times puts the copies outermost ([k, B*T] rows), an
        // order no flattened layout of the plan describes (DimKind: batch-major, sequence-major).
        const int64_t lead = static_cast<int64_t>(repeats->values.size()) - self->shape.rank;
        for (const auto& d : self->shape.dims)
          if (repeats->values[lead + d.dim] != 1)
            refuse(fmt::format("it repeats dimension {} of its input, a {} dimension", d.dim,
                               d.kind == DimKind::kBatch ? "batch" : "token"));
        break;
      }
    }
    if (whole) mark_run_whole(plan.nodes[i]);
  }
}

}  // namespace collider::detail

namespace collider {

std::vector<RowRuleInfo> row_rules() {
  std::vector<RowRuleInfo> out;
  for (const auto& [type, entry] : detail::row_rule_table())
    out.push_back(RowRuleInfo{type, detail::rule_name(entry.rule), entry.reason});
  return out;
}

}  // namespace collider
