// Analytic GEMM FLOPs of the causal LMs (forward, and backward per method), counted from the
// config the way the implementation executes them: 2*m*n*k per GEMM, eager attention computes
// the full T x T scores (not the causal half), the LM head is included, element-wise work
// (norms, softmax, activations, RoPE) and the embedding lookup count 0. Used for the FLOP ideal
// (DESIGN.md section 7), result rows (flops_fwd, flops_bwd) and `build/collider models`.
// Tested by tests/test_flops.cpp.
// Legend: B batch, T sequence, N kept tokens per row, D hidden, H heads, G kv-heads, E head dim,
// F ffn, V vocab, L layers.
#pragma once

#include "models/method.h"
#include "models/model_config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace collider::models {

// What the formulas read of a model: the shapes of its GEMMs. A ModelConfig converts to one
// (flop_shape.cpp: the MLP's matrices from its architecture); the Python bindings build one from a
// transformers config, so that python/bench counts with these formulas (flops.cpp needs neither
// the model zoo nor a kernel).
struct FlopShape {
  std::string name;
  int64_t vocab_size = 0;         // V
  int64_t hidden_size = 0;        // D
  int64_t intermediate_size = 0;  // F
  int64_t num_layers = 0;         // L
  int64_t num_heads = 0;          // H
  int64_t num_kv_heads = 0;       // G
  int64_t head_dim = 0;           // E
  int64_t mlp_matrices = 3;       // D x F matrices of an MLP (of each expert): SwiGLU 3, GELU 2
  int64_t num_experts = 0;        // X (0: a dense MLP)
  int64_t experts_per_token = 0;  // K

  FlopShape() = default;
  FlopShape(const ModelConfig& cfg);  // NOLINT: implicit, every formula below takes a preset too
};

struct FlopCount {
  double linear = 0;     // decoder projections: q, k, v, o (dense), MLP
  double attention = 0;  // attention core: Q K^T and P V (and their gradients)
  double lm_head = 0;    // LM head (tied or not)
  double total() const { return linear + attention + lm_head; }
};

// Forward, per batch of B x T tokens:
//   linear    = 2 * B*T * L * [D*H*E (q) + 2*D*G*E (k, v) + H*E*D (o) + MLP], MLP = 3*D*F SwiGLU,
//               2*D*F GELU, K*3*D*F + D*X mixture of experts (the routed work of K experts per
//               token and the router; a kept token's routes are cut with it, so Collider's
//               backward counts them at N like every token-wise GEMM)
//   attention = L * 2 GEMMs * 2 * B*H*T*T*E          (full T x T scores)
//   lm_head   = 2 * B*T * D*V
FlopCount forward_flops(const FlopShape& cfg, int64_t B, int64_t T);

// Forward of the method `spec`, N = kept tokens per row: forward_drop_forward_flops(B, T, N) for
// forward_drop (0 < N <= T), forward_flops(B, T) for every other method (N ignored: their forward
// sees every token). What a row's flops_fwd is.
FlopCount forward_flops(const FlopShape& cfg, int64_t B, int64_t T, int64_t N, const MethodSpec& spec);

// Backward of the method `spec` (its method and attention_grad; policy and score do not change
// the count for a given N), N = kept tokens per row (ignored by the dense methods; 0 < N <= T for
// collider; for forward_drop the tokens per row its middle layers see):
//   regular, loss_only, masked: every GEMM at full size, twice (dX and dW): 2 x forward_flops(B, T).
//   forward_drop: forward_drop_backward_flops(B, T, N) (below).
//   collider, kept_only:   token-wise GEMMs on N rows: linear, lm_head = 2 x forward at N;
//                attention core as if only the N kept tokens existed: 4 GEMMs (dP = dO V^T,
//                dV = P^T dO, dQ = dS K, dK = dS^T Q) of 2*B*H*N*N*E = 2 x forward attention at N.
//   collider, exact_query: token-wise GEMMs on N rows as above; attention: dP = dO V^T is N x T,
//                dQ = dS K contracts over T, dV = P^T dO and dK = dS^T Q are computed T x N and
//                gathered: 4 GEMMs of 2*B*H*N*T*E, per layer.
//   The embedding backward is a scatter-add: 0 GEMM FLOPs.
FlopCount backward_flops(const FlopShape& cfg, int64_t B, int64_t T, int64_t N, const MethodSpec& spec);

// The backward of a batch whose rows keep different counts (kept_per_row: one count per row, as
// batch_topk selects): collider row by row, a row that keeps nothing has no backward (ragged rows
// run just that: the token-row GEMMs on the packed kept rows, the attention cores row by row,
// collider_core/src/row_attention.h). Every other method: backward_flops(B = the rows, T, N =
// the first row's count, spec). Throws std::invalid_argument for no rows.
FlopCount backward_flops_rows(const FlopShape& cfg, int64_t T, const std::vector<int64_t>& kept_per_row,
                              const MethodSpec& spec);

// The FLOP ideal of DESIGN.md section 7: 1 - backward_flops_rows(kept_per_row, spec) / regular's
// backward on the same B x T batch.
double flop_ideal_reduction(const FlopShape& cfg, int64_t T, const std::vector<int64_t>& kept_per_row,
                            const MethodSpec& spec);

// forward_drop (forward token dropping, CausalLM::forward(input_ids, middle_BN)), N = tokens per
// row the middle layers see (0 < N <= T; needs L >= 3):
//   forward:  layers 0 and L-1 and the LM head at T tokens per row, the L-2 middle layers at N
//             (their attention N x N): forward_flops of those layer counts at T and at N.
//   backward: every GEMM of that forward twice (dX and dW): 2 x the forward.
FlopCount forward_drop_forward_flops(const FlopShape& cfg, int64_t B, int64_t T, int64_t N);
FlopCount forward_drop_backward_flops(const FlopShape& cfg, int64_t B, int64_t T, int64_t N);

// Forward attention-core FLOPs over forward decoder linear-layer FLOPs (LM head excluded) at
// sequence length T = 4*T*H*E / (2*[D*H*E + 2*D*G*E + H*E*D + M*D*F]); independent of B.
// Paper models at T = 2048: TinyLlama-1.1B 0.190, Qwen2.5-1.5B 0.134, Phi-1.5 0.167.
// DESIGN.md section 7: CPU presets keep this within 2x of the paper model's at T = 2048.
double attention_linear_ratio(const FlopShape& cfg, int64_t T);

}  // namespace collider::models
