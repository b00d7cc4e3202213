// Collider: filtered backward for token-filtered LLM training (arXiv 2502.00340).
// Public API (DESIGN.md section 4). One added line per training step:
//
//   collider::Plan plan = collider::trace_plan(
//       [&](int64_t batch, int64_t seq_len) { return loss_on_random_batch(model, batch, seq_len); });
//   ...
//   collider::FilterStats st = collider::filter_backward(loss, keep_mask_BT, plan, opts);
//   loss.backward();
//
// filter_backward rewrites the autograd graph hanging off `loss` in place: every saved
// activation with a token dimension is cut to the kept rows, recorded sizes and expected input
// shapes shrink, so the whole backward (GEMMs, norms, softmax, loss, embedding) runs on T' rows.
// Legend: B batch, T sequence, N = T' kept tokens per sequence (the largest count when ragged).
#pragma once

#include <collider/error.h>
#include <collider/head.h>
#include <collider/select.h>

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace collider {

// Attention gradient semantics (DESIGN.md section 3).
enum class AttentionGrad {
  kKeptOnly,    // paper v1: backward as if only kept tokens existed (P restricted, not renormalised)
  kExactQuery,  // v2 / Centrifuge: exact gradient of kept queries over all keys; dropped K/V detached
};
const char* to_string(AttentionGrad a);
AttentionGrad attention_grad_from_string(const std::string& s);  // "kept_only" | "exact_query"

// How often filter_backward checks a step against mask_backward by default (FilterOptions::check_every).
inline constexpr int64_t kDefaultCheckEvery = 1000;

struct FilterOptions {
  AttentionGrad attention = AttentionGrad::kKeptOnly;
  // Check this step against mask_backward (the same semantics on full-size tensors): both
  // backwards run inside the call, on the same graph, and every parameter's gradient must agree
  // (relative to its largest entry: 1e-4 in double, 1e-3 in float, 5e-2 in half precision), else
  // GradientMismatch naming the first node whose gradient differs, with the graph unchanged. It
  // costs two extra backwards.
  // Always on, and cheap: the loss must give dropped positions no gradient (a cross-entropy's
  // targets there are ignore_index, a per-position loss is masked there).
  bool validate = false;
  // The check on first use: the first filtered step of each kind the plan serves (its traced variant,
  // the semantics, equal or ragged kept counts) is checked as validate checks, and then every
  // check_every-th step filtered with the plan. 0: never by default (benchmarks). Skipped where the
  // graph holds a declared passthrough node (FSDP2's, which queue work for the end of the backward).
  int64_t check_every = kDefaultCheckEvery;
};

struct FilterStats {
  int64_t nodes_visited = 0;           // autograd nodes reachable from the loss
  int64_t nodes_rewritten = 0;         // nodes whose saved tensors, sizes or input shapes changed
  int64_t tensors_gathered = 0;        // distinct saved tensors cut to kept rows (one gather each)
  int64_t bytes_before = 0;            // bytes of those tensors before the cut
  int64_t bytes_gathered = 0;          // bytes of the cut copies
  int64_t tensors_hooked = 0;          // saved tensors behind saved-tensor hooks (checkpointing,
                                       // offloading), cut when the backward unpacks them; their
                                       // bytes are not known before then (not in the two above)
  int64_t gather_nodes_inserted = 0;   // exact_query: nodes that cut dK/dV to kept rows
  int64_t checked = 0;                 // 1: this step was checked against mask_backward (validate, or
                                       // the check on first use)
  int64_t gemms_packed = 0;            // ragged rows: token-row GEMMs run on the packed kept rows
  int64_t nodes_run_whole = 0;         // nodes that cannot be cut row by row (a scan, a convolution
                                       // along the tokens): their backward at full size
  int64_t batch = 0, seq_len = 0;      // B, T
  int64_t kept = 0;                    // positions per row after the cut: T', the largest kept count
  int64_t kept_total = 0;              // kept tokens over the batch (B * T' unless ragged)
  int64_t kept_min = 0, kept_max = 0;  // kept counts of the rows (differ under batch_topk)
  double rewrite_ms = 0.0;             // whole call
  double gather_ms = 0.0;              // of which: copies made inside the call (ragged attention
                                       // rows); saved tensors are cut in the backward, each when
                                       // its first reader unpacks it
};

// Per-node record of which dimensions of which fields are token dimensions, found by tracing.
// Replayed by node order at every step and validated against the node-type sequence.
class Plan {
 public:
  Plan();
  ~Plan();
  Plan(const Plan&);
  Plan& operator=(const Plan&);
  Plan(Plan&&) noexcept;
  Plan& operator=(Plan&&) noexcept;

  std::string to_string() const;
  static Plan from_string(const std::string& text);

  int64_t num_nodes() const;
  int64_t num_token_nodes() const;  // nodes with at least one token dimension
  std::string summary() const;      // one line: nodes, token nodes, attention cores

  // Adds the traced variants of `other`, a plan of the same model and loss traced another way
  // (with an attention mask where the first had none, ...): filter_backward uses the variant whose
  // node sequence is the graph's. Variants already held are not added twice.
  void merge(const Plan& other);
  int64_t num_variants() const;  // 2 from trace_plan (B > 1 and B = 1), more after merge

  struct Impl;
  const Impl& impl() const { return *impl_; }
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// loss_on_random_batch(batch, seq_len) builds the scalar loss of the model on a random batch of
// that shape (requires grad). It is called twice with sizes that cannot collide with model sizes.
using LossOnBatchFn = std::function<torch::Tensor(int64_t batch, int64_t seq_len)>;

struct TraceOptions {
  // Two (batch, seq_len) pairs; a dimension is a token dimension when it equals seq_len (or
  // batch*seq_len) in both traces. Primes chosen not to be model sizes.
  int64_t batch_a = 3, seq_a = 53;
  int64_t batch_b = 5, seq_b = 61;
};

Plan trace_plan(const LossOnBatchFn& loss_on_random_batch, const TraceOptions& opts = {});

// The one added line. keep_mask_BT: bool [B, T]. Rows may keep different numbers of tokens
// (batch_topk), every position, or none (such a row gives no gradient): ragged rows are cut to
// the largest count, the padding excluded exactly (collider_core/src/token_index.cpp).
FilterStats filter_backward(const torch::Tensor& loss, const torch::Tensor& keep_mask_BT, const Plan& plan,
                            const FilterOptions& opts = {});

// The `masked` method (the oracle of DESIGN.md section 3): the same semantics as
// filter_backward, computed on full-size tensors with dropped rows (and, in attention, columns)
// zeroed. No speed-up; used by tests and the harness as the reference.
FilterStats mask_backward(const torch::Tensor& loss, const torch::Tensor& keep_mask_BT, const Plan& plan,
                          const FilterOptions& opts = {});

// The rule by which collider cuts each autograd node type of this libtorch along a token
// dimension (docs/ROW_RULES.md): "pointwise", "layout", "along dim", "reduction", "norm", "matmul",
// "repeat", "lookup", "attention", or "refused" (a node of that type with a token dimension makes
// trace_plan refuse the model). Types no rule names are refused.
struct RowRuleInfo {
  std::string node_type;  // Node::name(), as declared in libtorch's Functions.h
  std::string rule;
  std::string reason;
};
std::vector<RowRuleInfo> row_rules();

// Custom autograd nodes (torch::autograd::Function) that carry no token-shaped saved state and
// map gradients row-for-row can be declared safe by their node name (e.g. timing markers). A
// Python custom Function needs no declaration: trace_plan runs its backward on cut rows and takes
// it where it maps rows one to one; a declared node is not run.
void register_passthrough_node(const std::string& node_name);

}  // namespace collider
