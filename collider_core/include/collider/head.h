// Collider's fused LM head: the language-model head and its cross-entropy in one op that scores
// every token but backpropagates only the kept ones, and never holds the [N, V] logits.
// Legend: N token rows (B * T, any leading shape flattened), D hidden, V vocabulary, K kept rows
// whose target is not ignore_index.
//
//   z      = softcap(logit_scale * (hidden W^T + bias))          [N, V], built one chunk at a time
//   lse    = logsumexp_v z                                        [N]
//   score  = lse - z[target]   (0 where target == ignore_index)   [N]  every row, no gradient
//   loss   = sum over kept rows of score / divisor                      scalar, the only output with a gradient
//
// The forward runs over all N rows in chunks of rows and of the vocabulary with an online
// log-sum-exp (float32 accumulation for 16-bit inputs), so at most one block of chunk_rows *
// chunk_vocab logits is alive. The gradient, from the K contributing rows only:
//   dz = (softmax(z) - onehot(target)) * d(loss),  d hidden = dz' W,  d W = dz'^T hidden,  d bias = sum dz'
// (dz' = dz through the soft-capping and the scale). fused_head_loss knows the keep mask in the
// forward: it scores the K rows in whole-vocabulary blocks and makes their gradient right there
// (for d(loss) = 1; the backward scales it): 2 N D V + 4 K D V FLOPs, the FLOP ideal of a head that
// scores every row and trains the kept ones (where a block holds 128 rows or more, or all of them; see
// HeadOptions::recompute). score_head cannot (RHO-1 picks the keep mask from its
// scores): it saves each row's log-sum-exp, ScoredHead::loss the K rows of `hidden` and their
// targets, and the backward recomputes their logits block by block: 2 K D V FLOPs more (also
// HeadOptions::recompute). Dropped rows get a zero gradient: in plain autograd a full-size hidden
// gradient with zeros there; inside filter_backward the gradient leaves the head already cut to
// the kept rows (the rest of the backward runs on them), with no full-size zeros built.
// Under filter_backward, `keep` must be the keep mask filter_backward is given, laid out [B, T] on
// the hidden states' rows (checked).
// Tests: tests/test_head.cpp, python/tests/test_head.py. Benchmark: python/bench/bench_head.py.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace collider {

struct HeadOptions {
  int64_t ignore_index = -100;  // targets equal to it are not scored and give no gradient
  double softcap = 0.0;         // final logit soft-capping, z = c tanh(z / c) (Gemma2: 30); 0: none
  double logit_scale = 1.0;     // z = logit_scale * logits before the capping (Cohere; Granite: 1 / its divisor)
  double divisor = 1.0;         // loss = sum / divisor: the caller's count; the head never renormalises
  bool entropy = false;         // also every row's entropy of softmax(z) (no gradient)
  int64_t chunk_rows = 1024;    // rows of one block of logits
  int64_t chunk_vocab = 8192;   // vocabulary columns of one block (float32: 32 MiB at the defaults)
  // fused_head_loss only: the kept rows' logits recomputed in the backward (as ScoredHead::loss
  // does) instead of their gradient made in the forward, which scores them chunk_rows *
  // chunk_vocab / V whole-vocabulary rows at a time. The forward way is taken where that is at
  // least 128 rows (V up to 65536 at the defaults) or one block holds every row; below, the
  // recompute is as fast on the CPU (python/bench/bench_head.py).
  bool recompute = false;
};

struct HeadResult {
  torch::Tensor loss;        // scalar, float32 for 16-bit inputs (float64 for float64); the gradient flows from it
  torch::Tensor token_loss;  // the shape of `targets`: every row's loss lse - z[target], 0 at ignore_index
  torch::Tensor entropy;     // the shape of `targets` when HeadOptions::entropy, else undefined
};

// The forward in two halves, for a keep mask chosen from the scores themselves (RHO-1 selects by
// each token's excess loss): score_head scores every row, ScoredHead::loss takes the keep mask
// and builds the loss with its backward. Between the two the head holds `hidden` (which the
// model's own graph holds anyway) and one float per row; nothing [N, V].
class ScoredHead {
 public:
  torch::Tensor token_loss;  // as HeadResult
  torch::Tensor entropy;
  // The loss over the kept rows (keep: bool of the targets' shape, or undefined: every row), sum /
  // divisor; its backward runs on the kept rows only. Once per ScoredHead or more (each a graph of
  // its own).
  torch::Tensor loss(const torch::Tensor& keep, double divisor = 1.0) const;

 private:
  friend ScoredHead score_head(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const HeadOptions&,
                               const torch::Tensor&);
  torch::Tensor hidden_, weight_, bias_, targets_, lse_;
  HeadOptions opts_;
};

// hidden [.., D] (N rows), weight [V, D] (tied embeddings: the embedding matrix itself), targets
// int64 of hidden's leading shape, bias [V] or undefined. Throws collider::Error on bad shapes,
// dtypes or targets outside [0, V). HeadOptions::divisor is ScoredHead::loss's argument here.
ScoredHead score_head(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                      const HeadOptions& opts = {}, const torch::Tensor& bias = torch::Tensor());

// Both halves in one call: keep bool of the targets' shape (or undefined: every row kept).
HeadResult fused_head_loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                           const torch::Tensor& keep, const HeadOptions& opts = {},
                           const torch::Tensor& bias = torch::Tensor());

// Whether fused_head_loss, with a gradient to make, recomputes the kept rows' logits in the backward
// (6 K D V backward FLOPs) rather than making their gradient in the forward (4 K D V): where
// opts.recompute, or where a block holds fewer than 128 whole-vocabulary rows (chunk_rows *
// chunk_vocab / vocab) and not every one of the `rows`.
bool fused_head_recomputes(int64_t rows, int64_t vocab, const HeadOptions& opts = {});

}  // namespace collider
