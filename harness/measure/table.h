// The console table of one measured group (what `collider run` prints after each group, and what
// bench_backward.toml is read by): per point its backward median and spread, the rewrite (in ms,
// and as a share of the point's backward and of regular's), the reduction against the group's
// regular point, the FLOP ideal and the share of it reached, the
// time over the T' floor (run.floor) and the peak memory. Collider's reduction and "vs floor"
// count bwd_ms + rewrite_ms (the rewrite is part of its backward's cost). Read from the rows
// alone (DESIGN.md section 6), so the same table can be printed for any results.jsonl.
// Tests: tests/test_sweep.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace collider::harness {

// The rows of one group, in manifest order; a failed row shows its status.
std::string group_table(const std::vector<nlohmann::json>& rows);

// A point's name in the table and in a round's progress line, from its identity: method[ attention_grad]
// [ batch_topk][@filter_ratio][ (A/A)], or "floor (regular at T'=N)" for a floor point
// (floor_seq_len = N > 0). ragged: a point that selects with batch_topk.
std::string point_label(const std::string& method, const std::string& attention_grad, bool ragged, double filter_ratio,
                        bool aa_copy, int64_t floor_seq_len);

}  // namespace collider::harness
