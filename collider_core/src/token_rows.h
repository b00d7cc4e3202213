// Internal: which token-sized dimensions hold the tokens, decided from the data flow. classify.h takes a
// dimension of size T in both traces for a token dimension; a second sequence of the same length (an
// encoder-decoder's source, padded to the target's length) looks the same by size. This step follows the
// rows instead: the loss's rows are the tokens; a node's input rows are its output's rows, except through
// the key and value operands of an attention (eager cores, attention_cores.h; fused attention, sdpa.h),
// whose rows are another sequence unless they meet the tokens again (a self-attention's keys come from the
// hidden states its queries come from). What only an attention's keys reach (an encoder) is not cut, and an
// attention from the tokens to it (a cross-attention) keeps all its key columns: its gradient is exact.
// A pass of the plan (passes/table.cpp), after the analysis steps. Tests: python/tests/test_encoder_decoder.py.
#pragma once

#include "graph.h"
#include "plan_impl.h"

namespace collider::detail {

// Clears the token dimensions of every field whose rows are another sequence than the tokens, and turns an
// attention core from the tokens to another sequence into an ordinary row-wise computation over the query
// rows (its key dimensions no token dimensions, no key-row inserts). Throws collider::Error where it cannot:
// a fused (SDPA) attention from the tokens to another sequence, or a core whose scores take a gradient
// from elsewhere (a learned bias over the two sequences).
void separate_sequences(const Graph& g, PlanData& plan);

}  // namespace collider::detail
