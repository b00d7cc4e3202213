// The figures of a measured group against its references (DESIGN.md section 7), computed in this
// one place: the measurement engine writes them into every row of a group (harness/measure/
// table.h: write_group_figures), the Python benchmark's rows get them through collider._measure
// (python/bench/bench_hf_backward.py), and every reader (the console table, the summaries, the
// plots) prints them as they are.
//   reduction       1 - cost / the baseline's cost: the backward time a row saves against the
//                   group's regular row, its rewrite counted (`cost`); 0 for the baseline itself,
//                   the A/A copy's is the noise of "no change"
//   step_reduction  1 - step_ms / the baseline's step_ms: the same for the whole step
//   of_ideal        reduction / the row's FLOP ideal (where the row has one: the filtering methods)
//   vs_floor        cost / the T' floor's cost, the floor measured in the same rounds at the row's
//                   T' (where the row names one); 1.0 is a backward as fast as one that never saw the
//                   dropped tokens
// NaN where a reference is missing (no baseline, no floor at that T', no ideal).
// Tests: tests/test_stats.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace collider::stats {

// One measured row of a group, as the figures need it.
struct GroupRow {
  enum class Role {
    kMethod,    // a method measured against the others
    kBaseline,  // the group's regular row: every reduction is against it
    kCopy,      // regular's A/A copy
    kFloor,     // regular at T' (run.floor), the floor of the rows whose t_prime is its t_prime
  };
  Role role = Role::kMethod;
  double cost_ms = NAN;     // the backward's median, with the rewrite where it is not inside it
  double step_ms = NAN;     // the whole step's median (NaN: not measured)
  double flop_ideal = NAN;  // 1 - the row's backward FLOPs / regular's (NaN: no ideal for this row)
  int64_t t_prime = -1;     // kFloor: the tokens per row it ran on; kMethod, kBaseline: the floor it is
                            // held to (-1: none)
};

struct GroupFigures {
  double reduction = NAN;
  double step_reduction = NAN;
  double of_ideal = NAN;
  double vs_floor = NAN;
};

// The figures of each row, in order. The first kBaseline row is the baseline; a floor serves
// every row of the same t_prime (the first floor of that t_prime, if several).
std::vector<GroupFigures> group_figures(const std::vector<GroupRow>& rows);

}  // namespace collider::stats
