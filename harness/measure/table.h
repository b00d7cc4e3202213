// A measured group's figures and its console table. write_group_figures: the engine writes each
// row's reduction, step_reduction, of_ideal and vs_floor (measuring/figures.h, one computation for
// every reader) when the group ends; Collider's cost counts bwd_ms + rewrite_ms (the rewrite is part
// of its backward's cost), collider and forward_drop rows are held to the FLOP ideal and to the
// floor at their T'. group_table: what `collider run` prints after each group (and what
// bench_backward.toml is read by): per point its backward median and spread, the rewrite (in ms,
// and as a share of the point's backward and of regular's), and the figures as the rows hold them,
// beside the FLOP ideal and the peak memory.
// Tests: tests/test_sweep.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace collider::harness {

// Writes the figures into the measured ("ok") rows of one group.
void write_group_figures(std::vector<nlohmann::json>& rows);

// The rows of one group, in manifest order, their figures written; a failed row shows its status.
std::string group_table(const std::vector<nlohmann::json>& rows);

// A point's name in the table and in a round's progress line, from its identity: method[ attention_grad]
// [ batch_topk][@filter_ratio][ (A/A)], or "floor (regular at T'=N)" for a floor point
// (floor_seq_len = N > 0). ragged: a point that selects with batch_topk.
std::string point_label(const std::string& method, const std::string& attention_grad, bool ragged, double filter_ratio,
                        bool aa_copy, int64_t floor_seq_len);

}  // namespace collider::harness
